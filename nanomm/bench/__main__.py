"""`python -m nanomm.bench ...` is `nanomm-bench ...` (nanomm/bench/cli.py)."""

import sys

from nanomm.bench.cli import main

sys.exit(main())
