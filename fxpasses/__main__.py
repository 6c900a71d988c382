"""``python -m fxpasses``: the ``fxpasses`` command line (see :mod:`fxpasses.cli`)."""

import sys

from .cli import main

sys.exit(main())
