"""Tests of storage: the HDF5 format written and read, shards, manifests, memory while writing."""
