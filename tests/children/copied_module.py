"""Use stocaching as a user who copied the one file would: run with ``python -I`` from the
directory that holds the copy (isolated: no PYTHONPATH, no script directory on the path), so
that ``import stocaching`` can only find the copy. Prints the sum read back and the module's
path.
"""

import sys

sys.path.insert(0, ".")

import stocaching  # noqa: E402
import torch  # noqa: E402

c = stocaching.SharedCache(1e-4, 10, (4,))
c.set_slot(1, torch.ones(4, dtype=torch.uint8))
# Every kind of cache lives in the one file: samples of fields, and of open sizes.
f = stocaching.SharedCache(1e-4, 10, {"x": (2,), "label": ()})
f.set_slot(0, {"x": torch.ones(2, dtype=torch.uint8), "label": 7})
assert int(f.get_slot(0)["label"]) == 7
o = stocaching.OpenSizeCache(1e-4, 10, (None, 2))
o.set_slot(0, torch.ones(3, 2, dtype=torch.uint8))
assert tuple(o.get_slot(0).shape) == (3, 2)
print(int(c.get_slot(1).sum()), stocaching.__file__)
