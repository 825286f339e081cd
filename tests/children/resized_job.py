"""One job of a training run that a launcher resizes: ``torchrun --nproc_per_node=N
resized_job.py STATE_IN STATE_OUT BATCHES OUT``.

Each rank builds a cache of 600 indices and a CacheAwareSampler over it (batch_size 8), loads
STATE_IN if it is not "-" (a state saved by a job of another size), iterates epoch 1 through a
DataLoader with 2 workers for BATCHES batches ("all": to the end of the epoch), and appends
the indices it got to OUT.rank<R> (JSON); rank 0 saves the sampler's state to STATE_OUT.
"""

import json
import sys

import torch
import torch.distributed as dist

from stocaching import CacheAwareSampler, SharedCache

N, BATCH = 600, 8


class Indices(torch.utils.data.Dataset):
    def __init__(self):
        self.cache = SharedCache(1e-3, N, (4,), random_subset=True)

    def __len__(self):
        return N

    def __getitem__(self, i):
        x = self.cache.get_slot(i)
        if x is None:
            x = torch.full((4,), i % 251, dtype=torch.uint8)
            self.cache.set_slot(i, x)
        return i


if __name__ == "__main__":
    state_in, state_out, batches, out = sys.argv[1:5]
    dist.init_process_group("gloo")
    ds = Indices()
    sampler = CacheAwareSampler(ds, batch_size=BATCH, seed=11)
    if state_in != "-":
        sampler.load_state_dict(torch.load(state_in))
    sampler.set_epoch(1)
    loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=2)
    got = []
    for k, batch in enumerate(loader):
        if batches != "all" and k == int(batches):
            break
        got += batch.tolist()
    with open(f"{out}.rank{dist.get_rank()}", "w") as f:
        json.dump(got, f)
    if dist.get_rank() == 0:
        consumed = None if batches == "all" else int(batches) * BATCH
        torch.save(sampler.state_dict(consumed=consumed), state_out)
    dist.barrier()
    ds.cache.close()
    dist.destroy_process_group()
