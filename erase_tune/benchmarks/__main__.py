"""``python -m erase_tune.benchmarks``: see :mod:`erase_tune.benchmarks.runner`."""

import sys

from erase_tune.benchmarks.runner import main

sys.exit(main())
