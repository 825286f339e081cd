"""A training process for tests/test_prefetch_processes.py's kill test.

Like prefetch_train.py, with the loads in 2 loader processes (``processes=2``): the load of
one index of the first epoch never returns, so the process is caught mid-epoch with loads in
flight in its loader processes. It prints ``READY <pid> <pid>`` (the loader processes) after
3 batches, then waits until it is killed. ``PREFETCH_START`` chooses the loader processes' start
method (default: the platform's).
"""

import os
import sys
import time

from torch.utils.data import DataLoader

from _helpers import budget_for
from prefetch_common import DIMS, PrefetchedDataset, Shuffled, value_of
from stocaching import Prefetcher, SharedCache

N = 64
STUCK = Shuffled(N).order(0)[40]


def load(i):  # runs in the loader processes, which import this module (spawn)
    if i == STUCK:
        time.sleep(3600)
    return value_of(i)


if __name__ == "__main__":
    cache = SharedCache(budget_for(32, DIMS, staging=64, dataset_len=N), N, DIMS,
                        staging_slots=64)  # in $STOCACHING_SHM_DIR
    ds = PrefetchedDataset(cache, N, value_of)
    sampler = Prefetcher(Shuffled(N), cache, load, window=8, mode="adaptive", processes=2,
                         timeout=3600, stand_aside=False,
                         multiprocessing_context=os.environ.get("PREFETCH_START") or None)
    loader = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2,
                        multiprocessing_context="fork")
    for step, _ in enumerate(loader):
        if step == 3:
            pids = " ".join(str(p.pid) for p in sampler._procs._procs)
            print(f"READY {pids}", flush=True)
    sys.exit("the epoch ended: the load of index %d should never have returned" % STUCK)
