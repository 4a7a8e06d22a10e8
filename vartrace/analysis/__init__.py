"""Reading runs after the fact: uniform sources, `compare`, plots, TensorBoard export, and
the same work as Dask tasks over a run's files (`scheduling`, `tasks`, `comparison.on_dask`,
`dask_frames`, `dask_arrays`)."""
