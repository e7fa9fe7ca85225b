"""``python -m generate``: the same as the ``generate`` command."""

import sys

from generate.tools.cli import main

sys.exit(main())
