"""One rank of tests/test_prefetch.py's DDP test, started by ``torchrun --nproc_per_node=2``.

Both ranks open one cache (half the indices have a slot, plus staging slots) and read it through
a DataLoader (2 fork workers) whose sampler is a Prefetcher around DistributedSampler, for 2
epochs. Loads are recorded in $TEST_OUT/loads (see prefetch_common.Loads); each rank writes
$TEST_OUT/rank<r>.json with what it read, whether every value was right, the segments it maps,
and (rank 0) the node's cache counters and the loads recorded after each epoch. Barriers around
every epoch make those per-epoch figures exact.
"""

import json
import os

import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from _helpers import budget_for, mapped_segments
from prefetch_common import DIMS, Loads, PrefetchedDataset, load_counts, value_of
from stocaching import Prefetcher, SharedCache, SlotState, World

N, SLOTS, STAGING, WINDOW, EPOCHS = 64, 32, 96, 8, 2

dist.init_process_group("gloo")
world = World.discover()
out = os.environ["TEST_OUT"]
loads = os.path.join(out, "loads")
cache = SharedCache(budget_for(SLOTS, DIMS, staging=STAGING, dataset_len=N), N, DIMS, name="pf",
                    staging_slots=STAGING, timeout=120)
dist.barrier()  # both ranks attached: the segment's name is gone
listed = sorted(os.listdir(os.environ["STOCACHING_SHM_DIR"]))
rank = dist.get_rank()
ds = PrefetchedDataset(cache, N, Loads(loads, f"worker{rank}"))
sampler = Prefetcher(DistributedSampler(ds, shuffle=True, seed=0), cache,
                     Loads(loads, f"prefetcher{rank}"), window=WINDOW, mode="adaptive", threads=4,
                     stand_aside=False)
loader = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2,
                    multiprocessing_context="fork")
result = {"rank": rank, "local_world_size": world.local_world_size, "listed": listed,
          "slots": len(cache), "staging_slots": cache.stats()["staging_slots"],
          "oob": [int(i) for i in (cache.aux_array.numpy() == SlotState.OOB.value).nonzero()[0]],
          "epochs": [], "stats": [], "loads_after": [], "values_ok": True}
for epoch in range(EPOCHS):
    sampler.set_epoch(epoch)
    before = cache.stats()
    dist.barrier()
    seen = []
    for idx, x in loader:
        for i, xi in zip(idx.tolist(), x):
            result["values_ok"] &= bool((xi == value_of(i)).all())
        seen += idx.tolist()
    dist.barrier()  # every rank's epoch is read: the node's counters and loads are final
    result["epochs"].append(seen)
    if rank == 0:
        s = cache.stats(since=before)
        result["stats"].append({k: s[k] for k in ("hits", "misses", "staged_hits")})
        result["loads_after"].append({str(i): w for i, w in load_counts(loads).items()})
        result["staged_after"] = cache.stats()["staged"]
    dist.barrier()
result["segments"] = sorted(map(list, mapped_segments(os.environ["STOCACHING_SHM_DIR"])))
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
dist.barrier()
dist.destroy_process_group()
