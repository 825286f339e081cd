"""Is the byte at OFFSET of the file at PATH record-locked by another process? Prints "held" or
"free" (taking and, on exit, dropping the lock when it was free).

Usage: lock_probe.py PATH OFFSET
"""

import fcntl
import os
import sys

path, offset = sys.argv[1], int(sys.argv[2])
fd = os.open(path, os.O_RDWR)
try:
    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, offset)
    print("free")
except OSError:
    print("held")
