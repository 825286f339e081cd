"""One local rank of a one-node job with a disk tier: 8 of 32 indices have a slot in
/dev/shm, the other 24 a row in the tier in $TEST_TIER. Each rank stores its share of all 32,
then reads all of them back (the other rank's tier rows included) and reports as JSON in
$TEST_SYNC/result.<rank>.json. Started by torchrun (TEST_DIST=1: the ranks meet through gloo).
"""

import json
import os

import torch
import torch.distributed as dist

from _helpers import budget_for, value_of
from stocaching import SharedCache, World

dims = (3, 8, 8)
dist.init_process_group("gloo")
world = World.from_env()
tier = os.environ["TEST_TIER"]
cache = SharedCache(budget_for(8, dims, dataset_len=32), 32, dims, name="t", timeout=60,
                    disk_tier=tier)
dist.barrier()
named = sorted(os.listdir(tier))  # every rank holds the tier: its name is gone
for i in range(world.local_rank, 32, world.local_world_size):
    assert cache.get_slot(i) is None
    cache.set_slot(i, value_of(i, dims))
dist.barrier()
ok = all(torch.equal(cache.get_slot(i), value_of(i, dims)) for i in range(32))
dist.barrier()
s = cache.stats()
with open(os.path.join(os.environ["TEST_SYNC"], f"result.{world.rank}.json"), "w") as f:
    json.dump({"rank": world.rank, "ok": ok, "named": named, "stats": s}, f)
cache.close()
dist.destroy_process_group()
