"""A training process for tests/test_prefetch.py's kill test.

A DataLoader with 2 fork workers reads a cache (half the indices with a slot, plus staging
slots) through a Prefetcher. The load of one index of the first epoch never returns, so the
process is caught mid-epoch with loads in flight in the prefetcher's threads: it prints
``READY`` after 3 batches, then waits inside the prefetcher until it is killed.
"""

import sys
import threading

from torch.utils.data import DataLoader

from _helpers import budget_for
from prefetch_common import DIMS, PrefetchedDataset, Shuffled, value_of
from stocaching import Prefetcher, SharedCache

N = 64
never = threading.Event()
base = Shuffled(N)
stuck = base.order(0)[40]


def load(i):
    if i == stuck:
        never.wait()
    return value_of(i)


cache = SharedCache(budget_for(32, DIMS, staging=64, dataset_len=N), N, DIMS,
                    staging_slots=64)  # in $STOCACHING_SHM_DIR
ds = PrefetchedDataset(cache, N, value_of)
sampler = Prefetcher(base, cache, load, window=8, mode="adaptive", threads=4, timeout=3600,
                     stand_aside=False)
loader = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2,
                    multiprocessing_context="fork")
for step, _ in enumerate(loader):
    if step == 3:
        print("READY", flush=True)
sys.exit("the epoch ended: the load of index %d should never have returned" % stuck)
