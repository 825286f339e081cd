"""A job that saves a cache to a file or loads one, for tests/test_saved.py.

``saved.py FILE N SLOW_MIB`` with ``SAVED_STEPS`` a comma-separated list of steps, run in order:

* ``load``: construct the cache of ``N`` samples of ``value_of(i, DIMS)`` with ``load_from=FILE``
  and print "LOADED k" (the samples it holds); ``new``: the same without ``load_from``;
* ``fill:A:B:S``: set the samples of ``range(A, B, S)``;
* ``save``: ``save(FILE)`` and print "SAVED samples bytes rewritten";
* ``check``: print "CHECKED k", k samples equal to ``value_of`` and the rest misses (or
  "WRONG i").

With ``SAVED_LOG`` set, the INFO lines of the stocaching logger go to stdout. With
``SLOW_MIB`` > 0, a write of at least that many MiB to the saved file prints "MID" (after
writing) and then sleeps, so that a test can kill the job inside a save. Under torchrun, every
local rank runs the steps; only rank 0 prints "SAVED".
"""

import logging
import os
import sys
import time

from _helpers import SAVED_DIMS as DIMS, value_of
import stocaching.saved as saved
from stocaching import SharedCache


def say(line: str) -> None:
    """One write of a whole line: the ranks under torchrun share this stdout, and print()
    writes its arguments and the newline one by one, which interleaved two ranks' lines."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()

path, n, slow_mib = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])

if os.environ.get("SAVED_LOG"):
    logging.basicConfig(stream=sys.stdout, level=logging.INFO)

if slow_mib > 0:
    pwrite = saved.pwrite_all

    def slow(fd, data, offset):
        done = pwrite(fd, data, offset)
        if done >= slow_mib * 2**20:
            say("MID")
            time.sleep(60)
        return done

    saved.pwrite_all = slow

cache = None
for step in os.environ["SAVED_STEPS"].split(","):
    if step in ("load", "new"):
        cache = SharedCache(n * 4200 / 2**30, n, DIMS, name="saved", timeout=60,
                            load_from=path if step == "load" else None,
                            key="k1" if step == "load" else "")
        say(f"LOADED {cache.stats()['filled']}")
    elif step.startswith("fill"):
        a, b, s = map(int, step.split(":")[1:])
        for i in range(a, b, s):
            cache.set_slot(i, value_of(i, DIMS))
    elif step == "save":
        out = cache.save(path)
        if out["saved"]:
            say(f"SAVED {out['samples']} {out['bytes']} {out['rewritten']}")
    elif step == "check":
        k = 0
        for i in range(n):
            got = cache.get_slot(i)
            if got is not None:
                if not (got == value_of(i, DIMS)).all():
                    say(f"WRONG {i}")
                k += 1
        say(f"CHECKED {k}")
