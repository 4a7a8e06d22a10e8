"""Tests of analysis: `vartrace.compare`, Dask, plots and TensorBoard."""
