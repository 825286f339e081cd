"""Build a cache, fill it, start two forked DataLoader workers (persistent, alive), read a batch
from each of them, say READY, then end as HOW says: "exit" (sys.exit(0)) or "exception" (an
uncaught exception) once its stdin is closed, or "wait" (sleep until the test sends a signal).
The test looks at who maps the cache between READY and the end it asks for.

A batch from each worker before READY, not just the first batch: torch's worker notes its
parent's pid (``os.getppid()``, for its ``ManagerWatchdog``) only after its start-up, just
before its loop. A worker still starting when its parent is killed notes the pid of the
process it was reparented to (1), never sees its parent go, and maps the cache for ever
(docs/troubleshooting.md, "Leaked segments"). Under load the second worker was still starting
when the first batch came back and the test killed the parent. A worker that has sent a
batch is in its loop, so it noted the parent while the parent was alive.

Usage: dataloader_then_end.py HOW. The segment directory comes from STOCACHING_SHM_DIR.
"""

import signal
import sys
import time

import torch

from _helpers import value_of
from stocaching import SharedCache

# The test's SIGINT and SIGTERM act as in a terminal even when the test runner was started with
# them ignored (a shell does that to SIGINT of a command run with '&'), a disposition children
# inherit; the forked workers inherit these.
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGTERM, signal.SIG_DFL)

how = sys.argv[1]
cache = SharedCache(1e-3, 64, (16,), name="life")
for i in range(64):
    cache.set_slot(i, value_of(i, (16,)))


class DS(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return cache.get_slot(i), torch.utils.data.get_worker_info().id


it = iter(torch.utils.data.DataLoader(DS(), batch_size=4, num_workers=2,
                                      persistent_workers=True))
seen: set = set()
while seen != {0, 1}:  # StopIteration (no READY, the test fails) if a worker never sends one
    _, worker_ids = next(it)
    seen.update(worker_ids.tolist())
print("READY", flush=True)
if how in ("exit", "exception"):
    sys.stdin.read()  # until the test closes our stdin
if how == "exit":
    sys.exit(0)
if how == "exception":
    raise RuntimeError("boom")
while True:  # until the signal the test sends (a sleep alone would end the test by time)
    time.sleep(1)
