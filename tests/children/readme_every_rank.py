"""The README's example under torchrun, with every rank reading every index (as in a validation
loop, without a DistributedSampler), through 2 DataLoader workers per rank: two processes often
load one index at once. Ten rounds, each with a new cache. Rank 0 prints one line per round:
"round K filled F of N, segments S".
"""

import os

import torch
import torch.distributed as dist

from stocaching import SharedCache, list_segments

N = 96


def load_and_resize(path: str) -> torch.Tensor:  # a deterministic stand-in for decoding
    i = int(path.split("-")[1])
    return torch.full((3, 16, 16), i % 251, dtype=torch.uint8)


class MyDataset(torch.utils.data.Dataset):  # the README's, with the names of this test
    def __init__(self, paths, name):
        self.paths = paths
        self.cache = SharedCache(size_limit_gib=1e-3, dataset_len=len(paths),
                                 data_dims=(3, 16, 16), name=name)

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        x = self.cache.get_slot(i)
        if x is None:
            x = load_and_resize(self.paths[i])
            self.cache.set_slot(i, x)
        return x


dist.init_process_group("gloo")
rank = dist.get_rank()
paths = [f"img-{i}" for i in range(N)]
for k in range(10):
    ds = MyDataset(paths, name=f"round{k}")
    loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2)
    for i, batch in enumerate(loader):
        want = torch.stack([load_and_resize(p) for p in paths[8 * i: 8 * i + 8]])
        assert torch.equal(batch, want), f"round {k}: batch {i} differs"
    dist.barrier()
    if rank == 0:
        segs = [s for s in list_segments(os.environ["STOCACHING_SHM_DIR"])
                if f"_round{k}" in s["path"]]
        print(f"round {k} filled {ds.cache.stats()['filled']} of {N}, segments {len(segs)}",
              flush=True)
    dist.barrier()
    ds.cache.close()
dist.destroy_process_group()
