"""What ``bench_overhead.py`` measures, by job: floors (``floors``), timed tables (``steps``),
the layer-by-layer breakdown (``breakdown``) and instruction counts (``instructions``)."""
