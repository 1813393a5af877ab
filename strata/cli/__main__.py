"""``python -m strata.cli``: the console script ``strata``."""

import sys

from strata.cli import main

sys.exit(main())
