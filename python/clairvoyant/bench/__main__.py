"""``python -m clairvoyant.bench``: see :mod:`clairvoyant.bench`."""

import sys

from . import main

sys.exit(main())
