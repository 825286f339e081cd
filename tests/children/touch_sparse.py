"""The control of fill_to_the_brim.py: a file of SIZE bytes at PATH, made with ftruncate and no
reservation, written through a mapping. Where the filesystem cannot supply a page on first
touch the process dies of SIGBUS.

Usage: touch_sparse.py PATH SIZE. Prints "FILLED" if it survives.
"""

import mmap
import os
import sys

import numpy as np

path, size = sys.argv[1], int(sys.argv[2])
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, size)  # no reservation: pages are found (or not) on first touch
np.frombuffer(mmap.mmap(fd, size), np.uint8)[:] = 1
print("FILLED", flush=True)
