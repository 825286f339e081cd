"""Build a cache in DIR with BUDGET GiB for N samples of (256, 1024) uint8, let a neighbour file
take every byte left on the filesystem, then fill every slot and read them all back.

Usage: fill_to_the_brim.py DIR BUDGET N. Prints "BUILT slots segment_bytes free_bytes" and
"FILLED filled wrong_values" (each sample is _helpers.value_of of its index). A page the
filesystem cannot supply would end it with SIGBUS.
"""

import errno
import os
import sys

import torch

from _helpers import value_of
from stocaching import SharedCache

d, budget, n = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
c = SharedCache(budget, n, (256, 1024), name="fits", shm_dir=d)
st = os.statvfs(d)
print("BUILT", len(c), c.stats()["bytes"], st.f_bavail * st.f_frsize, flush=True)
with open(os.path.join(d, "hog"), "wb", buffering=0) as hog:  # a neighbour takes the rest
    try:
        while True:
            hog.write(b"x" * 65536)
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
for i in range(len(c)):
    c.set_slot(i, value_of(i, (256, 1024)))
bad = sum(not torch.equal(c.get_slot(i), value_of(i, (256, 1024))) for i in range(len(c)))
print("FILLED", c.stats()["filled"], bad, flush=True)
