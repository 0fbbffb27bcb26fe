"""``python -m erase_tune`` runs the CLI (how the GPU machine runs it from a checkout)."""

import sys

from erase_tune.cli import main

sys.exit(main())
