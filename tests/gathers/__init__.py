"""Tests of gathering across ranks: real gloo process groups, node gathers, shards."""
