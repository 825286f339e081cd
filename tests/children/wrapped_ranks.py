"""A rank of a torchrun job that caches a dataset it did not write with CachedDataset: a
Hugging Face ``imagefolder`` dataset (``datasets``, with_format("torch")) of the PNGs in DIR,
decoded to a fixed size before the cache, flipped at random after it.

Usage: torchrun --nproc_per_node=2 wrapped_ranks.py DIR OUT. Each rank reads its share
(DistributedSampler) with 2 DataLoader workers for 2 epochs and writes OUT/rank<k>.json:
{"epochs": [{"indices": [...], "hits": n, "wrong": n}], "segments": n}, where wrong counts the
samples that differ from the PNG's own pixels (resized), flipped or not; each PNG's first
channel is its number, which says which index a sample is.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from stocaching import CachedDataset, list_segments

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_wrapper import SIZE, hf_imagefolder, resized, random_flip  # noqa: E402


def decode(item):
    return {"image": resized(item["image"]), "label": item["label"]}


def main() -> None:
    data, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    base = hf_imagefolder(data)
    ds = CachedDataset(base, decode=decode, transform=random_flip, name="hf")
    sampler = torch.utils.data.DistributedSampler(ds, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2)
    wanted = [resized(base[i]["image"]) for i in range(len(base))]
    index_of = {int(w[0, 0, 0]): i for i, w in enumerate(wanted)}  # (channel 0 names it)
    epochs = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        # The counts are the node's: every rank reads them between two barriers, while no
        # rank reads samples (one rank's next epoch ran into the other's count once, under load).
        before = ds.cache.stats()["hits"]
        dist.barrier()
        indices, wrong = [], 0
        for batch in loader:
            for got in batch["image"]:
                i = index_of[int(got[0, 0, 0])]
                want = wanted[i]
                wrong += not (torch.equal(got, want) or torch.equal(got, want.flip(-1)))
                indices.append(i)
        dist.barrier()
        epochs.append({"indices": indices, "hits": ds.cache.stats()["hits"] - before,
                       "wrong": wrong})
        dist.barrier()
    segments = len([s for s in list_segments(os.environ["STOCACHING_SHM_DIR"])
                    if s["state"] == "live"])
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"epochs": epochs, "segments": segments, "slots": len(ds.cache),
                   "len": len(ds)}, f)
    dist.barrier()
    ds.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
