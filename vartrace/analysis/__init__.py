"""Reading runs after the fact: uniform sources, `compare`, plots, TensorBoard export, and
the same work as Dask tasks over a run's files (`scheduling`, `tasks`, `distributed_compare`,
`dask_frames`, `dask_arrays`)."""
