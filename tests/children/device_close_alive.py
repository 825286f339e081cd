"""Close a DeviceLoader while an epoch's iterator is alive (issue 36), in one of the ways of
tests/test_device.py, and print what was seen as one JSON line.

Usage: device_close_alive.py SCENARIO N SLOTS STAGING

Attaches, as local rank 1, to the cache of ``N`` samples, ``SLOTS`` slots and ``STAGING``
staging slots that the test made as local rank 0 (the job key and segment directory come from
the environment), so that the test still sees the staging area once this process is gone. The
order runs from the last index down: the first batches are of indices without a slot, which
the prefetcher stages ahead, so that samples are staged when the loader is closed.

Scenarios:

* "plain": ``close()`` after one batch, the iterator suspended at its ``yield``;
* "another-thread": ``close()`` from another thread while this one waits in ``next(it)`` for a
  batch whose first sample's load is held back until the end;
* "with-block": leaving ``with DeviceLoader(...)`` with the iterator alive;
* "replaced": a second iterator started while the first is alive, read to its end;
* "exit": the program ends with the iterator alive, held by a global, the loader never closed.

Prints ``{"staged_at_close": ..., "staged_after": ..., "next": ..., "iter": ...}``: the staging
slots taken just before and after the close, and what ``next(it)`` (the one waiting, in
"another-thread") and a new ``iter(loader)`` raised after it (``"TypeName: message"``; None if
nothing). "replaced" prints ``"second"``,
the indices of the second iterator, and "another-thread" ``"close_returned"``.
"""

import json
import sys
import threading
import time

from _helpers import budget_for, value_of
from stocaching import DeviceLoader, SharedCache, World

scenario = sys.argv[1]
n, slots, staging = map(int, sys.argv[2:5])
dims = tuple(value_of(0).shape)
world = World(rank=1, world_size=2, local_rank=1, local_world_size=2)
cache = SharedCache(budget_for(slots, dims, staging=staging, dataset_len=n), n, dims,
                    staging_slots=staging, name="device-close", world=world)
order = list(range(n - 1, -1, -1))
first = order[0]
loading, gate = threading.Event(), threading.Event()


def load(i: int):
    if scenario == "another-thread" and i == first:  # held back: the batch cannot come
        loading.set()
        gate.wait(timeout=60)
    return value_of(i)


def loader() -> DeviceLoader:
    return DeviceLoader(cache, order, load, batch_size=4, device="cpu", threads=4)


def staged_soon(within: float = 30.0) -> int:
    """The staging slots taken, once the loads ahead have staged something (without, the
    scenario would test nothing); the deadline is reached only when the loader is broken."""
    deadline = time.monotonic() + within
    while (now := cache.stats()["staged"]) == 0:
        if time.monotonic() > deadline:
            raise SystemExit("nothing was staged: the scenario would test nothing")
        time.sleep(0.01)
    return now


def raised(step) -> str | None:
    try:
        step()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


seen: dict = {}
if scenario == "plain":
    L = loader()
    it = iter(L)
    next(it)
    seen["staged_at_close"] = staged_soon()
    L.close()
elif scenario == "another-thread":
    L = loader()
    it = iter(L)

    def close_once_waiting() -> None:
        assert loading.wait(timeout=30), "the held-back load never started"
        seen["staged_at_close"] = staged_soon()
        L.close()

    closer = threading.Thread(target=close_once_waiting, daemon=True)
    closer.start()
    seen["next"] = raised(lambda: next(it))  # wakes up when the loader is closed
    closer.join(timeout=30)
    seen["close_returned"] = not closer.is_alive()
elif scenario == "with-block":
    with loader() as L:
        it = iter(L)
        next(it)
        seen["staged_at_close"] = staged_soon()
elif scenario == "replaced":
    L = loader()
    it = iter(L)
    next(it)
    seen["second"] = [i for _, idx in L for i in idx.tolist()]
    seen["staged_at_close"] = cache.stats()["staged"]  # (the second epoch freed its own)
    L.close()
elif scenario == "exit":
    L = loader()
    it = iter(L)
    next(it)
    print(json.dumps({"staged_at_close": staged_soon()}), flush=True)
    raise SystemExit(0)  # the iterator is still alive, held by the global ``it``
else:
    raise SystemExit(f"unknown scenario {scenario!r}")
seen["staged_after"] = cache.stats()["staged"]
if "next" not in seen:
    seen["next"] = raised(lambda: next(it))
seen["iter"] = raised(lambda: next(iter(L)))
gate.set()
print(json.dumps(seen), flush=True)
