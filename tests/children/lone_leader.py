"""Local rank 0 of 2 (torchrun's variables) makes a cache that rank 1 never constructs, and
closes it. Prints "closed in S s" with the time close() took; close's warning (if it waited
and gave up) goes to stderr.

argv: shm_dir, timeout (the cache's, in seconds).
"""

import sys
import time

from stocaching import SharedCache

shm_dir, timeout = sys.argv[1], float(sys.argv[2])
cache = SharedCache(1e-3, 8, (4,), shm_dir=shm_dir, name="lone", timeout=timeout)
t0 = time.monotonic()
cache.close()
print(f"closed in {time.monotonic() - t0:.1f} s", flush=True)
