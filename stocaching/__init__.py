"""stocaching: a shared-memory cache of decoded samples for PyTorch datasets.

The whole runtime is the single module ``stocaching/stocaching.py``; this package re-exports it.
"""

from .stocaching import *  # noqa: F401,F403
from .stocaching import __all__, __version__  # noqa: F401
