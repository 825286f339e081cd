"""End with a prefetcher's iterator unfinished, in one of the orders of
tests/test_prefetch_closing.py, and write nothing on stderr.

Usage: prefetch_closing.py SCENARIO PROCESSES

Attaches, as local rank 1, to the cache that the test made as local rank 0 (the job key and
segment directory come from the environment), so that the test still sees the staging area
once this process is gone. Takes 20 indices of an epoch without reading them: their samples
stay staged, with the loads ahead, when the scenario begins.

Scenarios: "abandoned" (the iterator is dropped, then the program ends), "cache-closed-first",
"prefetcher-closed-first", "exit" (the program returns with the iterator unfinished, held by a
global), "exception" (the training loop raises inside ``with cache:``, and the exception, whose
traceback holds the iterator, is kept until the program ends).
"""

import gc
import sys
import warnings

from _helpers import budget_for
from prefetch_common import DIMS, Shuffled, value_of
from stocaching import Prefetcher, SharedCache, World

N, SLOTS, STAGING, TAKEN = 64, 16, 64, 20

scenario, processes = sys.argv[1], int(sys.argv[2])
world = World(rank=1, world_size=2, local_rank=1, local_world_size=2)
cache = SharedCache(budget_for(SLOTS, DIMS, staging=STAGING, dataset_len=N), N, DIMS,
                    staging_slots=STAGING, name="closing", world=world)
# (The construction's warning about a wide window over the first indices is not what this
# checks: the endings must be quiet.)
warnings.filterwarnings("ignore", message="window=8 is", category=UserWarning)
pf = Prefetcher(Shuffled(N, seed=1), cache, value_of, window=8, threads=4, processes=processes,
                stand_aside=False)


def started():
    it = iter(pf)
    for _ in range(TAKEN):
        next(it)
    assert cache.stats()["staged"] > 0, "nothing is staged: the scenario would test nothing"
    return it


if scenario == "abandoned":
    it = started()
    del it
    gc.collect()
elif scenario == "cache-closed-first":
    it = started()
    cache.close()
    del it
    gc.collect()
elif scenario == "prefetcher-closed-first":
    it = started()
    pf.close()
    del it
    gc.collect()
elif scenario == "exit":
    it = started()
elif scenario == "exception":
    try:
        with cache:
            for k, _ in enumerate(pf):
                if k == TAKEN:
                    raise RuntimeError("the training step failed")
    except RuntimeError as e:
        failure = e
else:
    raise SystemExit(f"unknown scenario {scenario!r}")
print("ENDING", flush=True)
