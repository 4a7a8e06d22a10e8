"""`python -m vartrace`: the `vartrace` command line (see `vartrace.cli`)."""

from vartrace.cli import main

raise SystemExit(main())
