"""Per-call cost of SharedCache: get_slot hit / miss, set_slot, construction, batched reads.

Run: ``python -m benchmark.microbench [--ref-dir DIR] [--construct-gib 1 8]``, or
``python -m benchmark.microbench --ref-dir DIR --before OLD_stocaching.py`` for the hit and write
paths of two versions of the core side by side.

Every figure is printed next to references measured in the same run (a bare ``clone()`` of one
slot, torch and numpy indexing), because a shared machine is noisy: compare ratios. Both modes
end with target lines, each ``[PASS]`` or ``[MISS]`` with the two figures compared: a batch of 64
hits read by ``get_batch`` against 64 ``get_slot`` calls and a ``torch.stack``; a hit of a
cache of open sizes against a bare ``clone()`` of the same bytes; how many images of varied
sizes fit in a budget against the sum of their sizes; and, with ``--before``, this core's
``get_slot`` hit against the older core's (its open-size hit is printed beside the older
core's too, without a target). ``--idioms`` times two choices of the core against their
alternatives (the record lock's pair of methods; caches past 30 instance attributes). With
``--ref-dir`` pointing at ``pip install --target DIR stocaching==0.2.1``, stocaching 0.2.1 is
measured too, imported under another name.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.util
import io
import itertools
import os
import sys
import time
import timeit

import numpy as np
import torch

import stocaching


def _per_call(fn, number: int, repeat: int = 7) -> float:
    """Median of ``repeat`` runs of ``number`` calls, in microseconds per call."""
    times = timeit.repeat(fn, number=number, repeat=repeat)
    return float(np.median(times)) / number * 1e6


def load_ref(ref_dir: str):
    """Import the stocaching installed in ``ref_dir`` (``pip install --target ref_dir
    stocaching==0.2.1``) as the module ``stocaching_ref``, beside the stocaching under test."""
    spec = importlib.util.spec_from_file_location(
        "stocaching_ref", os.path.join(ref_dir, "stocaching", "__init__.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def bench_calls(dims: tuple[int, ...], ref, n: int = 2000) -> list[tuple[str, float]]:
    number = 20000 if np.prod(dims) < 10000 else 2000
    x = torch.randint(0, 255, dims, dtype=torch.uint8)
    gib = (np.prod(dims) + 1) * n * 1.01 / 2**30
    rows = []
    with stocaching.SharedCache(gib, n, dims, name="microbench") as c:
        for i in range(n // 2):
            c.set_slot(i, x)
        arr = c.array
        rows.append(("bare clone() of one slot", _per_call(lambda: arr[5].clone(), number)))
        rows.append(("torch index view arr[i]", _per_call(lambda: arr[5], number)))
        rows.append(("get_slot hit (copy)", _per_call(lambda: c.get_slot(5), number)))
        rows.append(("get_slot hit (copy=False view)",
                     _per_call(lambda: c.get_slot(5, copy=False), number)))
        # The same slot again and again stays in the CPU cache; a training epoch reads each
        # slot once, from RAM. Cycle over the filled slots to see that cost too.
        cyc = itertools.cycle(range(n // 2))
        rows.append(("bare clone(), cycling over slots",
                     _per_call(lambda: arr[next(cyc)].clone(), number)))
        rows.append(("get_slot hit (copy), cycling", _per_call(lambda: c.get_slot(next(cyc)),
                                                               number)))
        rows.append(("get_slot miss (empty)", _per_call(lambda: c.get_slot(n - 1), number)))
        it = iter(range(n // 2, n))
        rows.append(("set_slot (fresh slot)", _per_call(lambda: c.set_slot(next(it), x), 500, 1)))
        rows.append(("set_slot overwrite",
                     _per_call(lambda: c.set_slot(7, x, allow_overwrite=True), number // 4)))
    with stocaching.SharedCache(gib / 2, n, dims, name="microbench-oob") as c:
        rows.append(("get_slot miss (out of bounds)", _per_call(lambda: c.get_slot(n - 1),
                                                                number)))
    if ref is not None:
        with contextlib.redirect_stdout(io.StringIO()):
            r = ref.SharedCache(gib, n, dims)
        r.set_slot(5, x)
        rows.append(("0.2.1 get_slot hit (view)", _per_call(lambda: r.get_slot(5), number)))
        rows.append(("0.2.1 hit + clone() (a safe copy)",
                     _per_call(lambda: r.get_slot(5).clone(), number)))
        rows.append(("0.2.1 get_slot miss (empty)", _per_call(lambda: r.get_slot(n - 1), number)))
        it = iter(range(n // 2, n))
        rows.append(("0.2.1 set_slot (fresh slot)",
                     _per_call(lambda: r.set_slot(next(it), x), 500, 1)))
    return rows


def load_core(path: str):
    """Import another copy of the core module (e.g. ``git show REV:stocaching/stocaching.py``)
    under another name, to time it beside this one."""
    spec = importlib.util.spec_from_file_location("stocaching_before", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def bench_side_by_side(dims: tuple[int, ...], ref, before, rounds: int = 25
                       ) -> list[tuple[str, float, float]]:
    """get_slot hit and set_slot (same dtype and shape, overwrite) of this core, of ``before``
    and of 0.2.1, interleaved round by round so that they share the machine's noise.

    Where a cache lies in memory moves a small hit by several percent (which of two caches is
    made first changed the minimum by up to 8 % on identical code), so this core and
    ``before`` get two caches each, made in the order now, before, before, now, and each
    label's times pool both; "now (A/A)" compares this core's two caches with each other, the
    noise the comparison with ``before`` sits in.

    Returns ``(name, min, median)`` in microseconds per call."""
    number = 20000 if np.prod(dims) < 10000 else 2000
    n = 1000
    x = torch.randint(0, 255, dims, dtype=torch.uint8)
    gib = (np.prod(dims) + 1) * n * 1.01 / 2**30
    order = ["now", "before", "before", "now"] if before is not None else ["now", "now"]
    caches = [(label, (stocaching if label == "now" else before).SharedCache(
        gib, n, dims, name=f"sbs-{label}-{k}")) for k, label in enumerate(order)]
    if ref is not None:
        with contextlib.redirect_stdout(io.StringIO()):
            caches.append(("0.2.1", ref.SharedCache(gib, n, dims)))
    for _, c in caches:
        c.set_slot(5, x)
        c.set_slot(7, x)
    times: dict[str, list[float]] = {}
    hits_of: dict[int, list[float]] = {}  # get_slot hit times, cache by cache
    for _ in range(rounds):
        for k, (label, c) in enumerate(caches):
            for what, fn in (("get_slot hit", lambda: c.get_slot(5)),
                             ("set_slot overwrite",
                              lambda: c.set_slot(7, x, allow_overwrite=True))):
                t = timeit.timeit(fn, number=number) / number * 1e6
                times.setdefault(f"{label:6s} {what}", []).append(t)
                if what == "get_slot hit":
                    hits_of.setdefault(k, []).append(t)
    for _, c in caches:
        if hasattr(c, "close"):
            c.close()
    out = [(k, min(v), float(np.median(v))) for k, v in times.items()]
    first, second = hits_of[0], hits_of[len(order) - 1]  # this core's two caches
    out.append(("A/A", min(first) / min(second), float(np.median(first) / np.median(second))))
    return out


class _HeldWith:
    """The record lock as a class-based context manager (the form the core does not use)."""

    __slots__ = ("cache", "offset")

    def __init__(self, cache, offset: int) -> None:
        self.cache, self.offset = cache, offset

    def __enter__(self) -> None:
        self.cache._segment.thread_lock.acquire()
        try:
            fcntl.lockf(self.cache._segment.fd, fcntl.LOCK_EX, 1, self.offset)
        except BaseException:
            self.cache._segment.thread_lock.release()
            raise

    def __exit__(self, *exc) -> None:
        try:
            fcntl.lockf(self.cache._segment.fd, fcntl.LOCK_UN, 1, self.offset)
        finally:
            self.cache._segment.thread_lock.release()


def bench_idioms(rounds: int = 15, number: int = 20000) -> dict[str, list[float]]:
    """Two choices of the core, each timed against its alternative, interleaved round by round.

    The record lock of one slot taken and released by the core's pair of methods
    (``lock``/``unlock`` of the segment, with ``try``/``finally``), against the same pair inside a
    ``__slots__`` context manager made for each ``with`` and against the lock taken by hand
    (``fcntl.lockf`` inside ``with`` the thread lock). And a ``get_slot`` hit of a cache with its
    own attributes (24 for a cache of one tensor, 35 for open sizes) against the same cache
    with 11 more (CPython 3.11 shares the keys of at most 30 instance attributes among a
    class's instances; past that an instance has a dict of its own).

    Returns microseconds per call of every round, by name."""
    class Padding:
        def __init__(self, *args, **kw) -> None:
            super().__init__(*args, **kw)
            for j in range(11):
                setattr(self, f"_padding{j}", None)

    class Padded(Padding, stocaching.SharedCache):
        pass

    class PaddedOpen(Padding, stocaching.OpenSizeCache):
        pass

    x = torch.randint(0, 255, (3, 8, 8), dtype=torch.uint8)
    caches = {}
    for name, kind, dims in (("SharedCache", stocaching.SharedCache, (3, 8, 8)),
                             ("SharedCache + 11", Padded, (3, 8, 8)),
                             ("OpenSizeCache", stocaching.OpenSizeCache, (3, None, None)),
                             ("OpenSizeCache + 11", PaddedOpen, (3, None, None))):
        c = kind(4 / 1024, 100, dims, name=f"microbench-idioms-{len(caches)}")
        c.set_slot(5, x)
        caches[name] = c
    c = caches["SharedCache"]
    offset = stocaching.stocaching.slot_lock_offset(7)  # the record lock of slot 7

    def pair():
        c._segment.lock(offset)
        try:
            pass
        finally:
            c._segment.unlock(offset)

    def with_object():
        with _HeldWith(c, offset):
            pass

    def by_hand():
        with c._segment.thread_lock:
            fcntl.lockf(c._segment.fd, fcntl.LOCK_EX, 1, offset)
            try:
                pass
            finally:
                fcntl.lockf(c._segment.fd, fcntl.LOCK_UN, 1, offset)

    calls = {"lock: lock/unlock pair": pair, "lock: with a __slots__ object": with_object,
             "lock: by hand (the old set_slot)": by_hand}
    for name, cache in caches.items():
        calls[f"hit: {name}"] = (lambda cache: lambda: cache.get_slot(5))(cache)
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, fn in calls.items():
            times.setdefault(name, []).append(timeit.timeit(fn, number=number) / number * 1e6)
    for name, cache in caches.items():  # counted after the timing: vars() builds the dict
        times[f"hit: {name} ({len(vars(cache))} attributes)"] = times.pop(f"hit: {name}")
        cache.close()
    return times


def bench_batch(dims: tuple[int, ...] = (3, 128, 128), batch: int = 64, rounds: int = 15,
                n: int = 2048) -> dict[str, list[float]]:
    """A batch of ``batch`` hits read by one ``get_batch`` against ``batch`` ``get_slot`` calls
    and a ``torch.stack``, interleaved round by round. The batches are random indices of ``n``
    filled slots (100 MB at the default sizes, more than a CPU cache holds, as in an epoch).

    Returns microseconds per sample of every round, by method."""
    x = torch.randint(0, 255, dims, dtype=torch.uint8)
    gib = (np.prod(dims) + 1) * n * 1.01 / 2**30
    rng = np.random.default_rng(0)
    batches = [rng.choice(n, batch, replace=False).tolist() for _ in range(64)]
    times: dict[str, list[float]] = {"get_batch": [], "get_slot + stack": []}
    with stocaching.SharedCache(gib, n, dims, name="microbench-batch") as c:
        for i in range(n):
            c.set_slot(i, x)
        k = itertools.count()

        def batched():
            out, hit = c.get_batch(batches[next(k) % 64])
            assert hit.all()

        def looped():
            rows = [c.get_slot(i) for i in batches[next(k) % 64]]
            return torch.stack(rows)

        for _ in range(rounds):
            for name, fn in (("get_batch", batched), ("get_slot + stack", looped)):
                times[name].append(timeit.timeit(fn, number=20) / 20 / batch * 1e6)
    return times


def bench_variable(n: int = 512, rounds: int = 15, before=None) -> dict[str, list[float]]:
    """A hit of a cache of open sizes, (3, None, None) uint8 images of 96-160 pixels a side
    (about 45 KB each, 23 MB in all), against a bare ``clone()`` of the same bytes (a tensor
    view of the sample in the cache's arena, as "bare clone() of one slot" above is of the
    slot), and of a private copy of each image; with ``before`` (another core), a hit of its
    cache of open sizes too (its ``OpenSizeCache``, or, in a core older than that class, its
    ``SharedCache``); the same index sequence for all, interleaved round by round.

    Returns microseconds per call of every round, by method."""
    rng = np.random.default_rng(1)
    images = [torch.randint(0, 255, (3, int(h), int(w)), dtype=torch.uint8)
              for h, w in rng.integers(96, 161, (n, 2))]
    gib = (sum(x.numel() for x in images) + 16 * n + 64 * n) * 1.01 / 2**30
    order = rng.integers(0, n, 4096).tolist()
    times: dict[str, list[float]] = {}
    old = None
    if before is not None:
        try:
            kind = getattr(before, "OpenSizeCache", before.SharedCache)
        except ImportError:  # a core of 2026-12-01 or later alone: open_size.py is not beside it
            print("(the older core copied alone has no OpenSizeCache: its open-size hit is not "
                  "timed)")
            kind = None
        if kind is not None:
            old = kind(gib, n, (3, None, None), name="microbench-var-before")
            for i, x in enumerate(images):
                old.set_slot(i, x)
    with stocaching.OpenSizeCache(gib, n, (3, None, None), name="microbench-var") as c:
        for i, x in enumerate(images):
            c.set_slot(i, x)
        assert c.stats()["filled"] == n
        arena = torch.from_numpy(c._arena)
        same = [arena[o: o + b].view(x.shape) for (o, b), x in
                zip(c._records_np[:, 1:3].tolist(), images)]  # the samples in the arena
        k = itertools.count()
        for _ in range(rounds):
            for name, fn in (("get_slot hit, open sizes",
                              lambda: c.get_slot(order[next(k) % 4096])),
                             ("bare clone() of the same bytes",
                              lambda: same[order[next(k) % 4096]].clone()),
                             ("bare clone() of a private copy",
                              lambda: images[order[next(k) % 4096]].clone()),
                             *([("get_slot hit, open sizes, before",
                                 lambda: old.get_slot(order[next(k) % 4096]))] if old else [])):
                times.setdefault(name, []).append(timeit.timeit(fn, number=1000) / 1000 * 1e6)
    if old is not None:
        old.close()
    return times


def bench_memory(budget_mib: float = 64, n: int = 4096) -> dict[str, int]:
    """How many variable-size images (3 x 64-256 x 64-256 uint8, in a fixed random order) a
    cache of open sizes admits in ``budget_mib``, against the most whose actual sizes sum to
    at most the budget, and against padding every image to the largest size."""
    rng = np.random.default_rng(2)
    sides = rng.integers(64, 257, (n, 2))
    sizes = [3 * int(h) * int(w) for h, w in sides]
    budget = int(budget_mib * 2**20)
    with stocaching.OpenSizeCache(budget / 2**30, n, (3, None, None), name="microbench-mem") as c:
        for i, (h, w) in enumerate(sides):
            c.set_slot(i, torch.zeros((3, int(h), int(w)), dtype=torch.uint8))
        admitted = c.stats()["filled"]
    ideal = int(np.searchsorted(np.cumsum(sizes), budget, side="right"))
    return {"admitted": admitted, "ideal": ideal, "padded": budget // max(sizes)}


def _verdict(ok: bool) -> str:
    return "[PASS]" if ok else "[MISS]"


def bench_construct(gib: float, ref) -> list[tuple[str, float]]:
    dims = (3, 256, 256)
    n = int(gib * 2**30 / (np.prod(dims) + 1))
    # Touch and drop a buffer of the same size first: on the 2-core VMs we measure on, memory
    # left idle for a few seconds goes back to the host, and touching it again was about 3.5x
    # slower (measured while timing stocaching 0.2.1's construction, torch 2.13.0+cpu).
    warm = np.ones(int(gib * 2**30), dtype=np.uint8)
    del warm
    # The kernel's share: reserve the same bytes in a bare tmpfs file (what any cache must pay).
    path = f"/dev/shm/microbench-reserve-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        t0 = time.perf_counter()
        os.posix_fallocate(fd, 0, int(gib * 2**30))
        reserve = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
    t0 = time.perf_counter()
    c = stocaching.SharedCache(gib, n, dims, name="microbench-build")
    rows = [(f"construct {gib:g} GiB", (time.perf_counter() - t0) * 1e6),
            (f"bare posix_fallocate {gib:g} GiB", reserve * 1e6)]
    c.close()
    del c
    if ref is not None:
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            r = ref.SharedCache(gib, n, dims)
        rows.append((f"0.2.1 construct {gib:g} GiB", (time.perf_counter() - t0) * 1e6))
        del r
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref-dir", default=None,
                    help="directory of `pip install --target DIR stocaching==0.2.1`")
    ap.add_argument("--construct-gib", type=float, nargs="*", default=[1, 8])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--before", default=None, metavar="CORE.py",
                    help="another copy of stocaching.py (e.g. from `git show REV:stocaching/"
                         "stocaching.py`): time its hit and write paths beside this one's "
                         "and 0.2.1's, interleaved, then stop")
    ap.add_argument("--idioms", action="store_true",
                    help="time the core's record-lock idiom against its alternatives, and a hit "
                         "of a cache with more than 30 instance attributes, then stop")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.idioms:
        print(f"torch {torch.__version__}, Python {sys.version.split()[0]}, "
              f"load average {os.getloadavg()[0]:.2f}")
        print("\ninterleaved rounds: min / median per call")
        for name, ts in bench_idioms().items():
            print(f"  {name:44s} {min(ts):7.3f} / {np.median(ts):7.3f} us")
        print(f"load average {os.getloadavg()[0]:.2f}")
        return
    ref = load_ref(args.ref_dir) if args.ref_dir else None
    print(f"torch {torch.__version__}, numpy {np.__version__}, {os.cpu_count()} cpus, "
          f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}")
    targets = []
    before = load_core(args.before) if args.before else None
    if before is not None:
        for dims in [(3, 32, 32), (3, 256, 256)]:
            print(f"\n{dims} uint8, interleaved rounds: min / median per call")
            rows = bench_side_by_side(dims, ref, before)
            for name, lo, med in rows:
                if name == "A/A":
                    print(f"  {'now, its 1st vs 2nd cache (A/A)':34s} {lo:7.3f} / {med:7.3f} "
                          f"(ratio of min / of median: the noise)")
                else:
                    print(f"  {name:34s} {lo:7.2f} / {med:7.2f} us")
            got = {name.split()[0]: (lo, med) for name, lo, med in rows
                   if name.endswith("get_slot hit")}
            (now, now_med), (old, old_med) = got["now"], got["before"]
            aa = next(lo for name, lo, _ in rows if name == "A/A")
            targets.append(f"{_verdict(now <= 1.05 * old)} get_slot hit {dims} uint8 within 5 % "
                           f"of {args.before}'s: {now:.2f} vs {old:.2f} us (min of rounds, "
                           f"two caches each; medians {now_med:.2f} vs {old_med:.2f} us), "
                           f"ratio {now / old:.3f} (this core against itself: {aa:.3f})")
    else:
        for dims in [(3, 32, 32), (3, 256, 256)]:
            print(f"\n{dims} uint8, median per call")
            for name, us in bench_calls(dims, ref):
                print(f"  {name:34s} {us:9.2f} us")
        print("\nconstruction (wall time)")
        for gib in args.construct_gib:
            for name, us in bench_construct(gib, ref):
                print(f"  {name:34s} {us / 1e6:9.3f} s")
    times = bench_batch()
    print("\n64 hits of (3, 128, 128) uint8, interleaved rounds: min / median per sample")
    for name, ts in times.items():
        print(f"  {name:34s} {min(ts):7.2f} / {np.median(ts):7.2f} us")
    b, s = float(np.median(times["get_batch"])), float(np.median(times["get_slot + stack"]))
    targets.append(f"{_verdict(s >= 1.5 * b)} get_batch of 64 hits >= 1.5 x faster per sample "
                   f"than 64 get_slot + torch.stack: {b:.2f} vs {s:.2f} us (medians), "
                   f"{s / b:.2f} x")
    times = bench_variable(before=before)
    print("\nopen sizes, (3, 96-160, 96-160) uint8, interleaved rounds: min / median per call")
    for name, ts in times.items():
        print(f"  {name:34s} {min(ts):7.2f} / {np.median(ts):7.2f} us")
    if "get_slot hit, open sizes, before" in times:
        now, old = times["get_slot hit, open sizes"], times["get_slot hit, open sizes, before"]
        print(f"  this core's open-size hit against {args.before}'s: ratio of min "
              f"{min(now) / min(old):.3f}, of median {np.median(now) / np.median(old):.3f}")
    v = float(np.median(times["get_slot hit, open sizes"]))
    b = float(np.median(times["bare clone() of the same bytes"]))
    targets.append(f"{_verdict(v <= 1.5 * b)} open-size get_slot hit <= 1.5 x a bare clone() of "
                   f"the same bytes: {v:.2f} vs {b:.2f} us (medians), {v / b:.2f} x")
    mem = bench_memory()
    print(f"\nopen sizes, 3 x 64-256 x 64-256 uint8 images in 64 MiB: {mem['admitted']} "
          f"admitted, {mem['ideal']} by the sum of their sizes, {mem['padded']} padded to the "
          f"largest")
    targets.append(f"{_verdict(mem['admitted'] >= 0.98 * mem['ideal'])} samples of varied size "
                   f"that fit in a budget within 2 % of the sum of their sizes: "
                   f"{mem['admitted']} vs {mem['ideal']} "
                   f"({100 * (1 - mem['admitted'] / mem['ideal']):.2f} % fewer; padded to the "
                   f"largest: {mem['padded']})")
    if not args.before:
        targets.append("(the get_slot hit path against an older core: pass --before CORE.py)")
    print(f"\nload average {os.getloadavg()[0]:.2f}; targets:")
    print("\n".join(targets))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
