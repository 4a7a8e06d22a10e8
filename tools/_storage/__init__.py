"""What ``bench_storage.py`` measures beside its own modes, by job: file sizes (``size``) and
many small sites (``sites``); :data:`GATHER`, the records of a gather in every mode."""

GATHER = 8
