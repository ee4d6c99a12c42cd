"""``python -m benches``: the benchmarks (see :mod:`benches.bench`)."""

import sys

from .bench import main

sys.exit(main())
