"""``python -m vartrace``: the ``vartrace`` command line (see :mod:`vartrace.cli`)."""

from vartrace.cli import main

raise SystemExit(main())
