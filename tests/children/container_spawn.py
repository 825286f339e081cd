"""Two ranks started by torch.multiprocessing.spawn (PyTorch's DDP tutorial) in whatever
memory cgroup the test put this program in: each builds the README's Dataset over a
size_limit_gib="auto" cache and reads its share with 2 DataLoader workers (spawned, as the
ranks' own start method is spawn) for 2 epochs.

Args: PORT N. Rank 0 prints one JSON line: {"slots", "bytes", "hits": [epoch 1, epoch 2],
"seen": samples both ranks read per epoch}.
"""

import json
import sys

import torch
import torch.distributed as dist

from _helpers import TwoLineDataset, spawn_without_launcher
from stocaching import SharedCache

DIMS = (3, 128, 128)


def rank_main(rank: int, port: int, n: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    cache = SharedCache("auto", n, DIMS, name="auto")
    ds = TwoLineDataset(cache, n)
    sampler = torch.utils.data.DistributedSampler(ds, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(ds, batch_size=64, sampler=sampler, num_workers=2)
    hits, seen = [], []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        before, count = cache.stats(), 0
        for _, x, _ in loader:
            count += len(x)
        dist.barrier()
        hits.append(cache.stats(since=before)["hits"])
        counts = [None, None]
        dist.all_gather_object(counts, count)
        seen.append(sum(counts))
    if rank == 0:
        print(json.dumps({"slots": len(cache), "bytes": cache.stats()["bytes"], "hits": hits,
                          "seen": seen}), flush=True)
    dist.barrier()
    cache.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    spawn_without_launcher(rank_main, (int(sys.argv[1]), int(sys.argv[2])))
