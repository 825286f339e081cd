"""Two ranks started by torch.multiprocessing.spawn with a gloo process group and no launcher
variables (PyTorch's DDP tutorial): they must share one cache, as under torchrun.

Args: SHM_DIR PORT. Rank 0 prints one JSON line with what both ranks saw.
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from _helpers import TwoLineDataset, spawn_without_launcher, value_of
from stocaching import CacheAwareSampler, SharedCache, list_segments

N = 100


def rank_main(rank: int, shm_dir: str, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    cache = SharedCache(1e-3, N, (3, 8, 8), shm_dir=shm_dir, name="spawned")
    if rank == 0:
        cache.set_slot(7, value_of(7))
    dist.barrier()
    seen = cache.get_slot(7)
    ds = TwoLineDataset(cache, N)
    ours = list(CacheAwareSampler(ds, batch_size=8))
    theirs = list(DistributedSampler(ds))
    every = [None, None]
    dist.all_gather_object(every, ours)
    report = {"world": [cache.world.local_rank, cache.world.local_world_size,
                        cache.world.node_rank, cache.world.num_nodes],
              "reads_rank0_write": seen is not None and bool(torch.equal(seen, value_of(7))),
              "len": len(ours), "len_distributed": len(theirs),
              "segments": len([s for s in list_segments(shm_dir) if "spawned" in s["path"]])}
    reports = [None, None]
    dist.all_gather_object(reports, report)
    if rank == 0:
        print(json.dumps({"ranks": reports, "covered": sorted(every[0] + every[1])}), flush=True)
    dist.barrier()
    cache.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    spawn_without_launcher(rank_main, (sys.argv[1], int(sys.argv[2])))
