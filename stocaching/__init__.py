"""stocaching: a shared-memory cache of decoded samples for PyTorch datasets.

The core is the single module ``stocaching/stocaching.py``: copy it alone into a project for
the two-line cache. Each advanced feature of the cache is a module beside it, loaded when its
keyword is used (disk_tier.py, saved.py, persistent.py, staging.py, batches.py, fields.py,
open_size.py, views.py, cli.py); the opt-in parts (samplers, orders, the prefetcher, mixtures,
the device loader, the wrappers, and what a trainer did to a sampler) are modules beside it
too. This package re-exports all of them.
"""

from .stocaching import *  # noqa: F401,F403
from .stocaching import __all__ as _core_all
from .stocaching import __version__  # noqa: F401
from .cli import list_segments, plan  # noqa: F401
from .open_size import OpenSizeCache  # noqa: F401
from .saved import describe_saved_file  # noqa: F401
from .views import ReadOnlyView  # noqa: F401
from .device import *  # noqa: F401,F403
from .device import __all__ as _device_all
from .mixtures import *  # noqa: F401,F403
from .mixtures import __all__ as _mixtures_all
from .order import *  # noqa: F401,F403
from .order import __all__ as _order_all
from .prefetch import *  # noqa: F401,F403
from .prefetch import __all__ as _prefetch_all
from .samplers import *  # noqa: F401,F403
from .samplers import __all__ as _samplers_all
from .streams import *  # noqa: F401,F403
from .trainers import *  # noqa: F401,F403
from .trainers import __all__ as _trainers_all
from .streams import __all__ as _streams_all
from .wrapper import *  # noqa: F401,F403
from .wrapper import __all__ as _wrapper_all

__all__ = [*_core_all, "OpenSizeCache", "ReadOnlyView", "describe_saved_file", "list_segments",
           "plan", *_samplers_all, *_order_all, *_prefetch_all, *_mixtures_all,
           *_device_all, *_wrapper_all, *_streams_all, *_trainers_all]
