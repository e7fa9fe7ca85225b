"""``python -m generate``: the same as the ``generate`` command."""

import sys

from generate.cli import main

sys.exit(main())
