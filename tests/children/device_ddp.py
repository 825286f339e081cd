"""Two ranks, each with a DeviceLoader (CPU) over a DistributedSampler on one node's cache:
started by ``torchrun --nproc_per_node=2`` (no argument) or by ``torch.multiprocessing.spawn``
(args: ``spawn PORT``, no launcher variables, as PyTorch's DDP tutorial does). With
``STOCACHING_TEST_DEVICE=cuda`` each rank's loader delivers on ``cuda:<local rank % GPUs>``, and
so registers the node's one segment with that GPU in its own process.

Half the indices have a slot, the rest are staged. Each rank reads 2 epochs and checks every row
against ``value_of``; rank 0 prints one JSON line: what each rank read per epoch, whether every
row was right, the segments each mapped (device, inode), and the staging slots still taken at the end.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DistributedSampler

from _helpers import budget_for, mapped_segments, value_of
from stocaching import DeviceLoader, SharedCache

N, SLOTS, STAGING, DIMS, EPOCHS = 60, 30, 64, (3, 8, 8), 2


def rank_main(rank: int, port: int | None) -> None:
    if port is None:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2)
    shm_dir = os.environ["STOCACHING_SHM_DIR"]
    cache = SharedCache(budget_for(SLOTS + STAGING, DIMS, dataset_len=N), N, DIMS, name="dev", staging_slots=STAGING,
                        timeout=120)
    sampler = DistributedSampler(range(N), shuffle=True, seed=3)
    device = os.environ.get("STOCACHING_TEST_DEVICE", "cpu")
    if device == "cuda":
        device = f"cuda:{rank % torch.cuda.device_count()}"
    loader = DeviceLoader(cache, sampler, lambda i: value_of(i, DIMS), batch_size=4,
                          device=device, threads=2)
    epochs, right = [], True
    for epoch in range(EPOCHS):
        loader.set_epoch(epoch)
        seen = []
        for batch, idx in loader:
            right &= all(bool((row == value_of(int(i), DIMS)).all())
                         for row, i in zip(batch.cpu(), idx.cpu()))
            seen += idx.tolist()
        epochs.append(seen)
        dist.barrier()
    mine = sorted(map(list, mapped_segments(shm_dir)))  # (device, inode) pairs
    report = {"rank": rank, "epochs": epochs, "right": right, "segments": mine,
              "len": len(loader), "slots": len(cache), "path": loader.path}
    reports = [None, None]
    dist.all_gather_object(reports, report)
    loader.close()
    dist.barrier()
    if rank == 0:
        print(json.dumps({"ranks": reports, "staged": cache.stats()["staged"]}), flush=True)
    cache.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1:2] == ["spawn"]:
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                    "GROUP_WORLD_SIZE", "NODE_RANK"):
            os.environ.pop(var, None)
        mp.spawn(rank_main, args=(int(sys.argv[2]),), nprocs=2)
    else:
        rank_main(int(os.environ["RANK"]), None)
