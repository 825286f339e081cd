"""The disk tier alone: ``python -m benchmark tier``.

A cache whose rows (``--rows`` of ``--dims`` uint8, random bytes) all live on the disk tier in
``--dir`` (one index has a slot in /dev/shm, the others a row in the tier's file), made
persistent so that its file has a name:

1. the rows are stored with ``set_slot`` (timed: rows/s written);
2. with the page cache cold (the file dropped from it before every pass: ``posix_fadvise
   DONTNEED`` after an ``fsync``, and ``/proc/sys/vm/drop_caches`` where this user may write it),
   then warm (read once before), a pass of ``get_slot`` over every tier row in a random order
   against a bare ``os.preadv`` loop over the same rows of the same file, in the same order,
   into a new buffer each (the disk's own speed, and the floor of any reader in Python);
   ``--repeats`` passes of each, alternating, medians compared;
3. a second job with a persistent cache: a cache of ``--memory-fraction`` of the rows in
   /dev/shm and the rest on the tier is filled and closed by a first job; the next job (a new
   cache of the same name and key, in this process) reads its epoch 1 (no load at all: every
   row is in /dev/shm or on the tier) and two more epochs; epoch 1 against the faster of them,
   with the page cache as the first job left it (and, informative, dropped first).

Target checks (measured, not asserted), as issue 38 states them: a row from the tier >= 0.8 x the
bare ``os.preadv`` loop, cold and warm; the second job's epoch 1 >= 0.8 x its warm epochs.
Every cache and file this command makes is removed at the end, also when it fails.
"""

from __future__ import annotations

import argparse
import math
import os
import secrets
import shutil
import statistics
import tempfile
import time
import warnings
from typing import Any, Callable, Sequence

import numpy as np

from . import arguments as A

READ_MIN = 0.8  # a tier read against the bare preadv loop
SECOND_JOB_MIN = 0.8  # the next job's epoch 1 against its warm epochs


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=A.positive_int, default=8000,
                   help="rows on the tier (default: %(default)s)")
    p.add_argument("--dims", type=A.positive_int, nargs="+", default=[3, 128, 128],
                   help="shape of a row, uint8 (default: 3 128 128, 48 KiB: the main "
                        "benchmark's decoded sample)")
    p.add_argument("--dir", default=None,
                   help="directory of the disk tier, on the disk to measure (default: the "
                        "system's temp directory)")
    p.add_argument("--repeats", type=A.positive_int, default=3,
                   help="passes of each reader, alternating; medians compared "
                        "(default: %(default)s)")
    p.add_argument("--memory-fraction", type=A.fraction, default=0.5,
                   help="the second-job scenario: share of the rows in /dev/shm, the rest on the "
                        "tier (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="default: %(default)s")


def drop_from_page_cache(path: str) -> bool:
    """Drop ``path`` from the page cache (its dirty pages written first); True where the
    whole page cache could be dropped too (root)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def _row(i: int, dims: Sequence[int], seed: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + i)
    return torch.randint(0, 256, tuple(dims), dtype=torch.uint8, generator=g)


def _bare_pass(path: str, offsets: np.ndarray, shape: tuple, row_bytes: int) -> float:
    """Rows/s of a bare ``os.preadv`` loop: each row into a new buffer, in the order given."""
    fd = os.open(path, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        for off in offsets.tolist():
            buf = np.empty(shape, np.uint8)
            if os.preadv(fd, [buf], off) != row_bytes:
                raise RuntimeError(f"short read at {off} of {path}")
        return len(offsets) / (time.perf_counter() - t0)
    finally:
        os.close(fd)


def _tier_pass(cache: Any, order: np.ndarray) -> float:
    """Rows/s of ``get_slot`` over ``order``; every row must be found."""
    t0 = time.perf_counter()
    for i in order.tolist():
        if cache.get_slot(i) is None:
            raise RuntimeError(f"get_slot({i}) missed a row stored on the tier")
    return len(order) / (time.perf_counter() - t0)


def _compare(say: Callable[[str], None], label: str, cache: Any, path: str, order: np.ndarray,
             offsets: np.ndarray, shape: tuple, row_bytes: int, repeats: int, cold: bool
             ) -> tuple[float, float]:
    bare, tier = [], []
    for k in range(repeats):
        for arm in (("bare", "tier") if k % 2 == 0 else ("tier", "bare")):
            if cold:
                drop_from_page_cache(path)
            else:
                _bare_pass(path, offsets, shape, row_bytes)  # (warm: every page read once)
            if arm == "bare":
                bare.append(_bare_pass(path, offsets, shape, row_bytes))
            else:
                tier.append(_tier_pass(cache, order))
    b, t = statistics.median(bare), statistics.median(tier)
    say(f"{label:6s} bare os.preadv {b:10,.0f} rows/s ({', '.join(f'{x:,.0f}' for x in bare)})"
        f"   get_slot from the tier {t:10,.0f} rows/s ({', '.join(f'{x:,.0f}' for x in tier)})")
    return b, t


def main(args: argparse.Namespace, argv: Sequence[str],
         say: Callable[[str], None] = print) -> int:
    import torch

    from stocaching import SharedCache, clean_segments

    torch.set_num_threads(1)
    dims, n = tuple(args.dims), args.rows
    row_bytes = math.prod(dims)
    load_before = os.getloadavg()
    shm_dir = os.environ.get("STOCACHING_SHM_DIR", "/dev/shm")
    tier_dir = tempfile.mkdtemp(prefix="stocaching-bench-tier-", dir=args.dir)
    name = f"bench-tier-{secrets.token_hex(3)}"
    names = [name, name + "-job"]
    say(f"{n} rows of {'x'.join(map(str, dims))} uint8 ({row_bytes / 1024:.0f} KiB) on the disk "
        f"tier in {tier_dir}; {args.repeats} passes of each reader, alternating")
    try:
        # 1-2: every row but one on the tier
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # (a disk short of room: said)
            cache = SharedCache((row_bytes + n + 1.5) / 2**30, n + 1, dims, name=name,
                                persistent=True, key="bench", disk_tier=tier_dir)
        tiered = np.flatnonzero(~cache.slot_mask())
        t0 = time.perf_counter()
        for i in tiered.tolist():
            cache.set_slot(i, _row(i, dims, args.seed))
        write = len(tiered) / (time.perf_counter() - t0)
        [path] = [os.path.join(tier_dir, f) for f in os.listdir(tier_dir)]
        order = np.random.default_rng(args.seed).permutation(tiered)
        # The file's layout, for the bare loop only: where each index's row starts.
        tier = cache._disk_tier
        offsets = np.array([tier._data_off + tier._positions[i] * row_bytes
                            for i in order.tolist()], np.int64)
        cold_all = drop_from_page_cache(path)
        say(f"written with set_slot: {write:,.0f} rows/s; the page cache is dropped "
            f"{'whole (drop_caches) and ' if cold_all else ''}for the file (fadvise) before "
            "each cold pass")
        cold = _compare(say, "cold", cache, path, order, offsets, dims, row_bytes,
                        args.repeats, True)
        warm = _compare(say, "warm", cache, path, order, offsets, dims, row_bytes,
                        args.repeats, False)
        st = cache.stats()
        cache.close()
        if st["disk_rows"] != len(tiered):
            raise RuntimeError(f"the tier holds {st['disk_rows']} rows, not {len(tiered)}")

        # 3: a second job with a persistent cache
        slots = int(args.memory_fraction * n)
        gib = (slots * row_bytes + n + 0.5) / 2**30
        kw: dict[str, Any] = dict(name=names[1], persistent=True, key="bench",
                                  disk_tier=tier_dir)
        with SharedCache(gib, n, dims, **kw) as first:
            for i in range(n):
                first.set_slot(i, _row(i, dims, args.seed))
        epochs: dict[str, list[float]] = {}
        for how in ("as left", "dropped"):
            with SharedCache(gib, n, dims, **kw) as job:
                if how == "dropped":
                    job_files = [f for f in os.listdir(tier_dir) if f.endswith("-job")]
                    drop_from_page_cache(os.path.join(tier_dir, job_files[0]))
                rng = np.random.default_rng(args.seed + 1)
                epochs[how] = [_tier_pass(job, rng.permutation(n)) for _ in range(3)]
                if how == "as left":
                    s = job.stats()
        for how, e in epochs.items():
            say(f"second job (page cache {how}): epoch 1 {e[0]:,.0f} rows/s, epochs 2-3 "
                f"{e[1]:,.0f}, {e[2]:,.0f} rows/s ({slots} rows in /dev/shm, {n - slots} on the "
                "tier, none loaded)")
        say(f"second job's stats: {s['hits']} hits, {s['disk_hits']} from the tier, "
            f"{s['misses']} misses")
    finally:
        clean_segments(shm_dir, persistent=names, disk_tier=tier_dir)
        shutil.rmtree(tier_dir, ignore_errors=True)
    load_after = os.getloadavg()
    say(f"load average at the start: {' '.join(f'{x:.2f}' for x in load_before)}; at the end: "
        f"{' '.join(f'{x:.2f}' for x in load_after)}")
    say("target checks (measured, not asserted):")
    for label, (b, t) in (("cold", cold), ("warm", warm)):
        r = t / b
        say(f"[{'PASS' if r >= READ_MIN else 'MISS'}] a row from the disk tier vs a bare "
            f"os.preadv loop, page cache {label}, target >= {READ_MIN:g} x: {t:,.0f} vs "
            f"{b:,.0f} rows/s ({r:.2f} x)")
    e = epochs["as left"]
    r = e[0] / max(e[1:])
    say(f"[{'PASS' if r >= SECOND_JOB_MIN else 'MISS'}] the second job's epoch 1 vs its faster "
        f"warm epoch (page cache as the first job left it), target >= {SECOND_JOB_MIN:g} x: "
        f"{e[0]:,.0f} vs {max(e[1:]):,.0f} rows/s ({r:.2f} x)")
    return 0
