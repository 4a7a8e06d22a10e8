"""Tests of what a reader is given: the README, docs/, examples, packaging and the layout."""
