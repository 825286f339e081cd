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
print(int(c.get_slot(1).sum()), stocaching.__file__)
