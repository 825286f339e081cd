"""Write through the read-only view that get_slot(copy=False) returns: the process must die of
SIGSEGV (the mapping is read-only) rather than change the cache silently.

Usage: write_a_view.py SHM_DIR. Prints "ok" before the write and "survived" after it.
"""

import sys

import torch

import stocaching

c = stocaching.SharedCache(1e-4, 10, (4,), shm_dir=sys.argv[1])
c.set_slot(1, torch.arange(4, dtype=torch.uint8))
v = c.get_slot(1, copy=False)
assert v.tolist() == [0, 1, 2, 3]
print("ok", flush=True)
v.add_(1)
print("survived", flush=True)
