"""Build a cache, fill it, start two forked DataLoader workers (persistent, alive), say READY,
then end as HOW says: "exit" (sys.exit(0)), "exception" (an uncaught exception) or "wait" (sleep
until the test sends a signal).

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
        return cache.get_slot(i)


it = iter(torch.utils.data.DataLoader(DS(), batch_size=4, num_workers=2,
                                      persistent_workers=True))
next(it)
print("READY", flush=True)
if how == "exit":
    sys.exit(0)
if how == "exception":
    raise RuntimeError("boom")
while True:  # until the signal the test sends (a sleep alone would end the test by time)
    time.sleep(1)
