"""Tests of the `vartrace` command."""
