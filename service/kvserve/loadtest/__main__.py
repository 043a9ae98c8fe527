"""``python -m kvserve.loadtest run|sweep|report``."""

import sys

from kvserve.loadtest.cli import main

sys.exit(main())
