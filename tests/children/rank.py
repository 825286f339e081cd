"""One local rank of a one-node job: attach to the node's cache, write this rank's share of 32
indices, read all of them back, and report as JSON (on stdout, and in
$TEST_SYNC/result.<rank>.json).

Started with the rank variables of ``rank_env`` or by torchrun. TEST_DIMS (JSON) is the sample
shape; with TEST_DIST=1 the ranks meet through a gloo process group, otherwise through files in
$TEST_SYNC (the cache needs no process group).
"""

import json
import os
import time

import torch
import torch.distributed as dist

from _helpers import value_of
from stocaching import SharedCache, World

dims = tuple(json.loads(os.environ.get("TEST_DIMS", "[3, 8, 8]")))
use_dist = os.environ.get("TEST_DIST") == "1"
if use_dist:
    dist.init_process_group("gloo")
world = World.from_env()
cache = SharedCache(1, 32, dims, name="t", timeout=60)


def barrier(tag):
    if use_dist:
        dist.barrier()
    else:  # without torch.distributed: wait on a file per rank
        open(os.path.join(os.environ["TEST_SYNC"], f"{tag}.{world.local_rank}"), "w").close()
        while len([f for f in os.listdir(os.environ["TEST_SYNC"]) if f.startswith(tag)]) \
                < world.local_world_size:
            time.sleep(0.01)


barrier("attached")
named = sorted(f for f in os.listdir(os.environ["STOCACHING_SHM_DIR"]))
# every rank writes its own indices, then every rank reads all of them
for i in range(world.local_rank, 32, world.local_world_size):
    cache.set_slot(i, value_of(i, dims))
barrier("written")
ok = all(torch.equal(cache.get_slot(i), value_of(i, dims)) for i in range(32))
barrier("read")
s = cache.stats()
result = json.dumps({"rank": world.rank, "ok": ok, "named": named, "stats": s})
with open(os.path.join(os.environ["TEST_SYNC"], f"result.{world.rank}.json"), "w") as f:
    f.write(result)
print(result, flush=True)
if use_dist:
    dist.destroy_process_group()
