"""A training process where users run: inside a memory cgroup, or with a small /dev/shm (the
test puts it there). It builds caches, then reads through a DataLoader, and says what happened.

Usage: container.py SPEC, SPEC a JSON object with
  caches:  a list of {"budget": "auto", GiB, or {"of_room": f}: f times the memory this
           process may still take, as plan() reads it; "n": samples, "dims": [..],
           "name": str, "disk_tier": a directory or absent}
  workers, batch, epochs: a DataLoader over the last cache (epochs 0: none)
  check:   read back every index of the last cache after the epochs, comparing each value
  fill:    before the epochs, write every index of the last cache (touches all its pages)

Prints JSON lines: {"cache": name, "slots", "bytes"} per cache; {"warning": category, "message"}
per warning; {"capacity_error": message, "path", "needed", "free"} if a cache is refused (and
then exits 0: the refusal is what the test looks at); {"epoch", "seen", "hits"} per epoch;
{"checked", "wrong"}; and {"left": names in /dev/shm (or $STOCACHING_SHM_DIR)} last.
"""

import json
import os
import sys
import warnings

import torch

from _helpers import TwoLineDataset, value_of
from stocaching import CacheCapacityError, SharedCache, plan


def say(**what) -> None:
    print(json.dumps(what), flush=True)


def main() -> None:
    spec = json.loads(sys.argv[1])
    caches = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            for c in spec["caches"]:
                budget = c["budget"]
                if isinstance(budget, dict):
                    budget = budget["of_room"] * plan(1, (1,))["ram_available_gib"]
                cache = SharedCache(budget, c["n"], tuple(c["dims"]), name=c["name"],
                                    disk_tier=c.get("disk_tier"))
                caches.append(cache)
                say(cache=c["name"], slots=len(cache), bytes=cache.stats()["bytes"])
        except CacheCapacityError as e:
            say(capacity_error=str(e), path=e.path, needed=e.needed, free=e.free)
        finally:
            for w in seen:
                say(warning=w.category.__name__, message=str(w.message))
    if len(caches) == len(spec["caches"]):
        cache, n = caches[-1], spec["caches"][-1]["n"]
        ds = TwoLineDataset(cache, n)
        if spec.get("fill"):
            for i in range(n):
                cache.set_slot(i, value_of(i, cache.data_dims))
        if spec.get("epochs"):
            loader = torch.utils.data.DataLoader(ds, batch_size=spec["batch"], shuffle=True,
                                                 num_workers=spec["workers"])
            for epoch in range(spec["epochs"]):
                seen_n = hits = 0
                for _, x, hit in loader:
                    seen_n, hits = seen_n + len(x), hits + int(hit.sum())
                say(epoch=epoch, seen=seen_n, hits=hits)
        if spec.get("check"):
            wrong = sum(not torch.equal(ds[i][1], value_of(i, cache.data_dims))
                        for i in range(n))
            say(checked=n, wrong=wrong)
    for cache in caches:
        cache.close()
    shm = os.environ.get("STOCACHING_SHM_DIR", "/dev/shm")
    say(left=sorted(f for f in os.listdir(shm) if f.startswith("stocaching")))


if __name__ == "__main__":
    main()
