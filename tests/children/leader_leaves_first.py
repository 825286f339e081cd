"""Under torchrun --nproc_per_node=2: local rank 0 makes the cache, fills it and is done
before local rank 1 has even constructed it (a short job, or a rank slowed by its imports).
Rank 1 constructs only after rank 0 has announced, through a file, that it is closing. Rank 1
prints "hits H of N" for what it then reads; rank 0 prints "closed" when its close returned.

argv: shm_dir, the announcement file.
"""

import os
import sys
import time

import torch

from stocaching import SharedCache

N = 32
shm_dir, announce = sys.argv[1], sys.argv[2]
rank = int(os.environ["LOCAL_RANK"])


def value(i: int) -> torch.Tensor:
    return torch.full((8,), i, dtype=torch.int64)


if rank == 0:
    cache = SharedCache(1e-3, N, (8,), torch.int64, name="early", shm_dir=shm_dir, timeout=60)
    for i in range(N):
        cache.set_slot(i, value(i))
    with open(announce, "w") as f:
        f.write("closing")
    cache.close()  # waits for rank 1 to attach
    print("closed", flush=True)
else:
    deadline = time.monotonic() + 60
    while not os.path.exists(announce):
        assert time.monotonic() < deadline, "rank 0 never announced"
        time.sleep(0.01)
    time.sleep(0.5)  # and rank 0 is in close() by now, most likely
    cache = SharedCache(1e-3, N, (8,), torch.int64, name="early", shm_dir=shm_dir, timeout=20)
    hits = 0
    for i in range(N):
        x = cache.get_slot(i)
        hits += x is not None and torch.equal(x, value(i))
    print(f"hits {hits} of {N}", flush=True)
    cache.close()
