"""Stress: the torture of tests/test_concurrency.py for as many reads as you ask, with what each
bad read saw recorded beside it. Not a test (pytest does not collect it); run it by hand:

    python tests/stress_reads.py --reads 100_000_000 --busy 2

Readers (half started by fork, half by spawn) read the few indices of one small cache as fast as
they can, with a few writes, overwrites and clear() calls among the reads; a clearer process
refills every slot and clears them all, over and over. Every sample read is checked against the
table of valid values (tests/test_concurrency.py's ``_table``: byte 0 the version, bytes 1-4 the
index, a CRC at the end, so a torn, foreign or zeroed row fails). Beside each read the reader
records the slot's sequence number just before and just after ``get_slot`` and the index's state
after it; a bad read prints them. ``--busy N`` adds N processes that only spin, as another job
on the machine; run the suite's other concurrency tests beside it for the rest of the load. It
prints the load average at the start and the end, and exits 1 if any read was bad.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_concurrency import DATASET_LEN, N_SLOTS, WIDTH, _clearer, _table  # noqa: E402

from _helpers import budget_for  # noqa: E402
from stocaching import SharedCache  # noqa: E402

CHUNK = 50_000
WRITE, WRITE_IF_EMPTY, CLEAR = 0.01, 0.02, 0.99998  # of the operations: below, below, above


def _reader(cache: SharedCache, seed: int, reads_wanted: int, done, out) -> None:
    """Reads until ``reads_wanted``; puts its counts and up to 10 bad reads on ``out``."""
    torch.set_num_threads(1)
    table = _table()
    values = torch.from_numpy(table)
    versions, states = cache._slot_versions, cache._index_states  # for the record only
    rng = np.random.default_rng(seed)
    rows = np.empty((CHUNK, WIDTH), np.uint8)
    read_idx = np.empty(CHUNK, np.int64)
    seen = np.empty((CHUNK, 3), np.int64)  # number before, number after, state after
    counts = dict(reads=0, misses=0, corrupt=0, writes=0, clears=0)
    bad_reads = []
    while counts["reads"] < reads_wanted:
        n = 0
        for i, p in zip(rng.integers(0, DATASET_LEN, CHUNK).tolist(),
                        rng.random(CHUNK).tolist()):
            if p < WRITE:
                cache.set_slot(i, values[i, int(p * 25_600) % 256], allow_overwrite=True)
                counts["writes"] += 1
            elif p < WRITE_IF_EMPTY:
                try:
                    cache.set_slot(i, values[i, int(p * 12_800) % 256])
                    counts["writes"] += 1
                except RuntimeError:
                    pass
            elif p > CLEAR:
                cache.clear()
                counts["clears"] += 1
            else:
                before = versions[i] if i < N_SLOTS else -1
                x = cache.get_slot(i)
                counts["reads"] += 1
                if x is None:
                    counts["misses"] += 1
                    continue
                rows[n] = x.numpy()
                read_idx[n] = i
                seen[n] = before, versions[i] if i < N_SLOTS else -1, states[i]
                n += 1
        bad = np.flatnonzero(~(rows[:n] == table[read_idx[:n], rows[:n, 0]]).all(1))
        counts["corrupt"] += int(bad.size)
        for j in bad[:10 - len(bad_reads)].tolist():
            bad_reads.append({"idx": int(read_idx[j]), "row": rows[j].tolist(),
                              "seq before": int(seen[j, 0]), "seq after": int(seen[j, 1]),
                              "state after": int(seen[j, 2])})
        with done.get_lock():
            done.value += CHUNK
    out.put({**counts, "bad": bad_reads, "pid": os.getpid()})


def _spin(stop) -> None:
    """Another job on the machine: a core kept busy until ``stop``."""
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reads", type=lambda s: int(s.replace("_", "")), default=100_000_000,
                    help="reads in all (default: 100_000_000)")
    ap.add_argument("--readers", type=int, default=4, help="reader processes (default: 4)")
    ap.add_argument("--busy", type=int, default=0, help="spinning processes beside (default 0)")
    args = ap.parse_args(argv)
    fork, spawn = mp.get_context("fork"), mp.get_context("spawn")
    shm_dir = tempfile.mkdtemp(prefix="stress-", dir="/dev/shm")
    cache = SharedCache(budget_for(N_SLOTS, (WIDTH,), dataset_len=DATASET_LEN), DATASET_LEN,
                        (WIDTH,), name="stress", shm_dir=shm_dir)
    out, done, stop = spawn.Queue(), spawn.Value("q", 0), spawn.Event()
    each = -(-args.reads // args.readers)
    readers = [(fork if k % 2 == 0 else spawn).Process(
        target=_reader, args=(cache, k, each, done, out)) for k in range(args.readers)]
    others = [fork.Process(target=_clearer, args=(cache, stop, out))] + \
        [fork.Process(target=_spin, args=(stop,)) for _ in range(args.busy)]
    load_at_start = os.getloadavg()
    t0 = time.perf_counter()
    for p in others + readers:
        p.start()
    results, last = [], t0
    while len(results) < len(readers):
        try:
            results.append(out.get(timeout=1))
        except queue.Empty:
            failed = [p.exitcode for p in readers if p.exitcode not in (None, 0)]
            if failed:
                print(f"a reader failed: exit codes {failed}", file=sys.stderr)
                return 2
        if time.perf_counter() - last > 30:
            last = time.perf_counter()
            print(f"  {done.value:,} reads, {last - t0:.0f} s, load {os.getloadavg()[0]:.1f}",
                  flush=True)
    wall = time.perf_counter() - t0
    stop.set()
    clearer = out.get(timeout=120)
    for p in others + readers:
        p.join(60)
    cache.close()
    os.rmdir(shm_dir)
    total = {k: sum(r[k] for r in results) for k in ("reads", "misses", "corrupt", "writes",
                                                     "clears")}
    print(f"{total['reads']:,} reads ({total['misses']:,} misses), "
          f"{total['writes'] + clearer['stored']:,} writes, "
          f"{total['clears'] + clearer['clears']:,} clears: {total['corrupt']} corrupt, "
          f"in {wall:.0f} s by {args.readers} readers (fork and spawn), 1 clearer and "
          f"{args.busy} busy processes; load average {load_at_start[0]:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} (1 min) and {os.getloadavg()[1]:.1f} (5 min) at the end, "
          f"{os.cpu_count()} cores")
    for r in results:
        for b in r["bad"]:
            print(f"  bad read in pid {r['pid']}: {b}")
    return 1 if total["corrupt"] else 0


if __name__ == "__main__":
    sys.exit(main())
