"""The README's pattern where it is hardest on /dev/shm: uint8 samples in a cache sized by
"auto", float32 batches out of the Dataset (converted after the cache), handed over by
DataLoader workers through /dev/shm. Run by the test inside a small /dev/shm (and a memory
cgroup), as one process or as each rank of ``torchrun``.

Usage: float_batches.py SPEC, SPEC a JSON object with
  n, dims:   samples and their shape (uint8 in the cache)
  cache:     true for the cache ("auto"), false for the same job without it (the baseline)
  disk_tier: a directory, or absent
  workers, batch, epochs, start: the DataLoader (start: its multiprocessing context)

Each rank reads its share (indices rank, rank + world, ...). Prints one JSON line per rank:
{"rank", "slots", "anonymous", "segment" (what /proc/self/fd names the segment: "/memfd:..."
for an anonymous one), "epochs": [{"seen", "hits", "sum"}]}.
"""

import json
import os
import sys

import torch

from _helpers import value_of
from stocaching import SharedCache


class FloatAfterTheCache(torch.utils.data.Dataset):
    def __init__(self, cache, n, dims, indices):
        self.cache, self.n, self.dims, self.indices = cache, n, tuple(dims), indices

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, k):
        i = self.indices[k]
        x = None if self.cache is None else self.cache.get_slot(i)
        hit = x is not None
        if x is None:
            x = value_of(i, self.dims)
            if self.cache is not None:
                self.cache.set_slot(i, x)
        return x.float().div_(255), hit  # float32 from here on: 4 x the bytes of the sample


def main() -> None:
    spec = json.loads(sys.argv[1])
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    cache = SharedCache("auto", spec["n"], tuple(spec["dims"]), name="float",
                        disk_tier=spec.get("disk_tier")) if spec["cache"] else None
    said = {"rank": rank, "slots": 0 if cache is None else len(cache),
            "anonymous": bool(getattr(cache, "_anonymous", False)),
            "segment": "" if cache is None else os.readlink(f"/proc/self/fd/{cache._segment.fd}"),
            "epochs": []}
    ds = FloatAfterTheCache(cache, spec["n"], spec["dims"], list(range(rank, spec["n"], world)))
    loader = torch.utils.data.DataLoader(
        ds, batch_size=spec["batch"], num_workers=spec["workers"],
        multiprocessing_context=spec.get("start"), persistent_workers=False)
    for _ in range(spec["epochs"]):
        seen = hits = 0
        total = 0.0
        for x, hit in loader:
            assert x.dtype is torch.float32
            seen, hits, total = seen + len(x), hits + int(hit.sum()), total + float(x.sum())
        said["epochs"].append({"seen": seen, "hits": hits, "sum": round(total, 3)})
    print(json.dumps(said), flush=True)
    if cache is not None:
        cache.close()


if __name__ == "__main__":
    main()
