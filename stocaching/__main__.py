"""``python -m stocaching``: shared-memory status, sizing and clean-up."""

import sys

from .stocaching import main

sys.exit(main())
