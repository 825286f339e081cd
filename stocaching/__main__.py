"""``python -m stocaching``: shared-memory status, sizing and clean-up."""

import sys

from .cli import run_cli

sys.exit(run_cli())
