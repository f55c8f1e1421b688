"""``python -m longtrain``: the ``longtrain`` command."""

import sys

from longtrain.cli import main

sys.exit(main())
