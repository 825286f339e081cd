"""Learning quality of the Prefetcher's orders: ``python -m benchmark quality``.

Trains a small plain-torch CNN on scikit-learn's digits (1,797 8x8 images of 10 classes; the
data ships with scikit-learn) with these orders over several seeds:

- ``random``: ``RandomSampler``, the plain DataLoader;
- ``fixed``: ``Prefetcher(RandomSampler(...), window=W, mode="fixed")``, W = 4 batches;
- ``adaptive``: the same with ``mode="adaptive"``;
- ``fixed-large``, ``adaptive-large``: the same with a window of a third of the epoch;
- over a cache that holds the first indices (0.2.1's layout, ``random_subset=False``, the
  default): ``ReadyFirstSampler(RandomSampler(...), cache, window=W)`` alone, its misses
  loaded by the DataLoader, with the docs' window, 256 (``order-docs-first``: checked to be
  warned at construction, or else within one standard deviation of ``random``), and with the
  widest window that does not warn, ``n // WIDE_WINDOW_PART`` (``order-bound-first``:
  checked to be unwarned and within one standard deviation of ``random``); and
  ``fixed-large`` there (``fixed-large-first``, shown);

and reports the test accuracy (mean +- standard deviation over the seeds) of each, with a
PASS/MISS line per checked arm: within one standard deviation of ``random``.

The training set is sorted by class, as ImageFolder sorts a dataset, and the cache holds a
fraction f of it (default 0.5). The checked arms use the documented usage for such data,
``SharedCache(..., random_subset=True)``: the cached samples are a random subset of every
class. With the first indices cached instead, the cached samples are those of the first
classes, and an order that prefers cached samples puts them first in every epoch. On the label
sequences that the training actually consumed, the command also reports the mean number of
distinct classes per batch and the mean label entropy per batch of each arm against
``random`` (target: within 1 %), over all batches and, to show where a difference comes from,
without the first and last ceil(W / B) batches of each epoch.

Misses of the prefetching arms are loaded by the Prefetcher with an EMULATED lognormal latency
(default median 2 ms, p99 10 x that), so that which samples are ready varies as in a real run;
the ``random`` arm has no added latency (it cannot change its order or its accuracy). The
same seed gives every arm the same initial model and the same base order.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import secrets
import shlex
import statistics
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

import stocaching

from . import arguments as A
from . import latency as L
from . import report
from .two_lines import TwoLineDataset

DIVERSITY_TOL = 0.01
DOCS_WINDOW = 256  # the README's Prefetcher example


@dataclasses.dataclass(frozen=True)
class Arm:
    """One order to train with: a prefetcher's ``mode`` and ``window`` (None: the plain
    ``RandomSampler``), which indices the cache holds, and whether its accuracy is checked."""

    name: str
    mode: str | None = None
    window: int = 0
    random_subset: bool = True
    checked: bool = True
    guard: str = ""  # over the first indices: "warned or close", "unwarned and close"
    prefetch: bool = True  # False: a ReadyFirstSampler alone, misses loaded by the loader


def arms_for(n: int, args: argparse.Namespace) -> list[Arm]:
    large = args.large_window or max(1, n // 3)
    return [Arm("random"),
            Arm("fixed", "fixed", args.window), Arm("adaptive", "adaptive", args.window),
            Arm("fixed-large", "fixed", large), Arm("adaptive-large", "adaptive", large),
            Arm("order-docs-first", "fixed", DOCS_WINDOW, random_subset=False, checked=False,
                guard="warned or close", prefetch=False),
            Arm("order-bound-first", "fixed", max(1, n // stocaching.WIDE_WINDOW_PART),
                random_subset=False, checked=False, guard="unwarned and close", prefetch=False),
            Arm("fixed-large-first", "fixed", large, random_subset=False, checked=False)]


def load_digits_sorted(test_fraction: float = 0.25, split_seed: int = 0
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's digits as uint8 ``(n, 1, 8, 8)`` (values 0..16) and int64 labels,
    split stratified into train and test (``split_seed``, fixed over the training seeds);
    the training set is sorted by class (stable)."""
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as e:  # pragma: no cover - the benchmark extra installs it
        raise SystemExit("python -m benchmark quality needs scikit-learn: pip install "
                         "scikit-learn (or pip install -e '.[benchmark]')") from e
    d = load_digits()
    x = d.images.astype(np.uint8)[:, None]
    y = d.target.astype(np.int64)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=test_fraction,
                                          random_state=split_seed, stratify=y)
    order = np.argsort(ytr, kind="stable")
    return xtr[order], ytr[order], xte, yte


class Digits(TwoLineDataset):
    """The two-line cached dataset: ``get_slot``, else ``load`` + ``set_slot``. Returns
    ``(float image / 16, label)``. ``load`` sleeps ``delays[i]`` first (EMULATED latency)."""

    def __init__(self, x: np.ndarray, y: np.ndarray, cache: Any = None,
                 delays: np.ndarray | None = None) -> None:
        self.x, self.y, self.cache, self.delays = torch.from_numpy(x), y, cache, delays

    def __len__(self) -> int:
        return len(self.y)

    def load(self, i: int) -> torch.Tensor:
        if self.delays is not None:
            time.sleep(float(self.delays[i]))
        return self.x[i].clone()

    def item(self, i: int, x: torch.Tensor, hit: bool) -> tuple[torch.Tensor, int]:
        return x.float().div_(16.0), int(self.y[i])


class DigitsNet(nn.Module):
    """Two 3x3 convs (the second with stride 2), then a linear head: about 10 k parameters."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
            nn.Flatten(), nn.Linear(32 * 4 * 4, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def batch_diversity(labels: np.ndarray, classes: int) -> tuple[int, float]:
    """``(distinct classes, label entropy in bits)`` of one batch's labels."""
    counts = np.bincount(labels, minlength=classes)
    p = counts[counts > 0] / labels.size
    return int((counts > 0).sum()), float(-(p * np.log2(p)).sum())


def train_arm(arm: Arm, seed: int, data: tuple[np.ndarray, ...], args: argparse.Namespace,
              name: str) -> dict[str, Any]:
    """Train one (arm, seed); returns its test accuracy and the labels of every full batch,
    with each batch's position in its epoch."""
    xtr, ytr, xte, yte = data
    n = len(ytr)
    slots = min(n, round(args.fraction * n))
    staging = args.staging_slots
    cache = stocaching.SharedCache(L._gib(slots, staging, n, 64), n, (1, 8, 8), torch.uint8,
                                   name=name, staging_slots=staging, layout_seed=seed,
                                   random_subset=arm.random_subset)
    ds = Digits(xtr, ytr, cache)
    lat = L.Latency("lognormal", args.latency_ms, args.p99_ratio) if args.latency_ms > 0 \
        else L.Latency("none")
    base = torch.utils.data.RandomSampler(ds, generator=torch.Generator().manual_seed(seed))
    sampler: Any = base
    warned = False
    if arm.mode is not None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sampler = stocaching.Prefetcher(base, cache, ds.load, window=arm.window,
                                            mode=arm.mode, threads=args.threads) \
                if arm.prefetch else \
                stocaching.ReadyFirstSampler(base, cache, window=arm.window, mode=arm.mode)
        warned = any("random_subset=True" in str(w.message) for w in caught)
    loader = torch.utils.data.DataLoader(ds, batch_size=args.batch_size, sampler=sampler,
                                         num_workers=0)
    torch.manual_seed(seed)
    model = DigitsNet()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    batches: list[tuple[int, int, np.ndarray]] = []  # (epoch, batch in epoch, labels)
    hits = reads = 0
    try:
        for epoch in range(args.epochs):
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
            # (a latency changes what is ready only where a prefetcher loads ahead)
            ds.delays = lat.delays(n, seed, epoch) if arm.mode and arm.prefetch else None
            s0 = cache.stats()
            model.train()
            for k, (x, y) in enumerate(loader):
                opt.zero_grad(set_to_none=True)
                loss_fn(model(x), y).backward()
                opt.step()
                if y.numel() == args.batch_size:
                    batches.append((epoch, k, y.numpy().copy()))
            st = cache.stats(since=s0)
            if epoch > 0:
                hits, reads = hits + st["hits"], reads + st["hits"] + st["misses"]
        model.eval()
        with torch.no_grad():
            pred = model(torch.from_numpy(xte).float() / 16.0).argmax(1).numpy()
    finally:
        loader = sampler = None
        ds.cache = None
        cache.close()
    return {"arm": arm.name, "window": arm.window, "checked": arm.checked, "seed": seed,
            "accuracy": float((pred == yte).mean()), "warned": warned,
            "batches": batches, "hit_rate_later": hits / reads if reads else math.nan}


def diversity(runs: Sequence[dict[str, Any]], batch_size: int, window: int,
              trim: bool) -> tuple[float, float]:
    """Mean distinct classes and mean entropy (bits) per full batch over ``runs``; with
    ``trim``, without the first and last ceil(window / batch_size) batches of each epoch."""
    edge = -(-window // batch_size)
    uniq, ent = [], []
    for r in runs:
        per_epoch = max(k for _, k, _ in r["batches"]) + 1 if r["batches"] else 0
        for _, k, labels in r["batches"]:
            if trim and (k < edge or k >= per_epoch - edge):
                continue
            u, h = batch_diversity(labels, 10)
            uniq.append(u)
            ent.append(h)
    return statistics.fmean(uniq), statistics.fmean(ent)


def check_lines(runs: Sequence[dict[str, Any]], arms: Sequence[Arm], args: argparse.Namespace
                ) -> tuple[list[str], list[dict[str, Any]], list[str]]:
    """The table lines, the checks and their text."""
    by = {a.name: [r for r in runs if r["arm"] == a.name] for a in arms}
    window = {a.name: a.window for a in arms}
    acc = {a: [r["accuracy"] for r in rs] for a, rs in by.items() if rs}

    def sd(v: Sequence[float]) -> float:
        return statistics.stdev(v) if len(v) > 1 else 0.0

    table = [f"{'arm':<17} {'W':>4} {'test accuracy (mean +- std)':>28}  {'seeds':>5}  "
             f"{'distinct classes/batch':>22}  {'entropy bits/batch':>18}  "
             f"{'hit rate e>=2':>13}"]
    div = {a: diversity(rs, args.batch_size, window[a], False) for a, rs in by.items() if rs}
    mid = {a: diversity(rs, args.batch_size, window[a], True) for a, rs in by.items() if rs}
    for a, rs in by.items():
        if not rs:
            continue
        hr = statistics.fmean(r["hit_rate_later"] for r in rs)
        table.append(f"{a:<17} {window[a]:>4} {100 * statistics.fmean(acc[a]):>19.2f} % +- "
                     f"{100 * sd(acc[a]):.2f}  {len(rs):>5}  {div[a][0]:>22.3f}  "
                     f"{div[a][1]:>18.3f}  {hr:>13.3f}")
    checks, text = [], []
    ref = acc.get("random")
    for arm in arms:
        a = arm.name
        if arm.mode is None or a not in acc or not ref:
            continue
        m, mr, s = statistics.fmean(acc[a]), statistics.fmean(ref), sd(ref)
        if arm.guard:
            warned = all(r["warned"] for r in by[a])
            close = abs(m - mr) <= s
            ok = (warned or close) if arm.guard == "warned or close" else \
                (not any(r["warned"] for r in by[a]) and close)
            checks.append({"name": f"default layout {a}", "status": "PASS" if ok else "MISS",
                           "measured": {"warned": warned, "difference": m - mr},
                           "target": arm.guard})
            text.append(f"[{'PASS' if ok else 'MISS'}] the first indices cached (the default), "
                        f"W = {arm.window}, target {arm.guard} (within one standard deviation "
                        f"of random): {'warned' if warned else 'not warned'} at construction; "
                        f"{100 * m:.2f} % +- {100 * sd(acc[a]):.2f} vs {100 * mr:.2f} % "
                        f"(difference {100 * (m - mr):+.2f} points, std of random "
                        f"{100 * s:.2f} points), distinct classes per batch {div[a][0]:.3f} vs "
                        f"{div['random'][0]:.3f}")
            continue
        if not arm.checked:
            text.append(f"[shown] test accuracy, {a} (the first indices cached, W = "
                        f"{arm.window}) vs random: {100 * m:.2f} % +- {100 * sd(acc[a]):.2f} vs "
                        f"{100 * mr:.2f} % (difference {100 * (m - mr):+.2f} points), "
                        f"distinct classes per batch {div[a][0]:.3f} vs {div['random'][0]:.3f} "
                        f"({div[a][0] / div['random'][0] - 1.0:+.2%}): why a class-ordered "
                        "dataset takes random_subset=True")
            continue
        ok = abs(m - mr) <= s
        checks.append({"name": f"accuracy {a}", "status": "PASS" if ok else "MISS",
                       "measured": m - mr, "target": "|difference| <= std of random"})
        text.append(f"[{'PASS' if ok else 'MISS'}] test accuracy, {a} vs random, target within "
                    f"one standard deviation of random: {100 * m:.2f} % vs {100 * mr:.2f} % "
                    f"(difference {100 * (m - mr):+.2f} points, std of random "
                    f"{100 * s:.2f} points, {len(acc[a])} seeds)")
        for stat, k in (("distinct classes per batch", 0), ("label entropy per batch", 1)):
            x, xr = div[a][k], div["random"][k]
            ok = abs(x / xr - 1.0) <= DIVERSITY_TOL
            checks.append({"name": f"{stat} {a}", "status": "PASS" if ok else "MISS",
                           "measured": x / xr - 1.0, "target": f"within {DIVERSITY_TOL:.0%}"})
            text.append(f"[{'PASS' if ok else 'MISS'}] {stat}, {a} vs random (class-sorted "
                        f"training set, batch {args.batch_size}, W = {arm.window}), target "
                        f"within {DIVERSITY_TOL:.0%}: {x:.3f} vs {xr:.3f} ({x / xr - 1.0:+.2%}); "
                        f"without the first and last {-(-arm.window // args.batch_size)} "
                        f"batches of each epoch: {mid[a][k]:.3f} vs {mid['random'][k]:.3f} "
                        f"({mid[a][k] / mid['random'][k] - 1.0:+.2%})")
    return table, checks, text


def add_arguments(p: argparse.ArgumentParser) -> None:

    p.add_argument("--seeds", type=A.positive_int, default=5,
                   help="training seeds per arm (default: %(default)s)")
    p.add_argument("--epochs", type=A.positive_int, default=15, help="default: %(default)s")
    p.add_argument("--batch-size", type=A.positive_int, default=16, help="default: %(default)s")
    p.add_argument("--window", type=A.positive_int, default=None,
                   help="W of the prefetching arms (default: 4 batches)")
    p.add_argument("--large-window", type=A.positive_int, default=None,
                   help="W of the -large arms (default: a third of the epoch)")
    p.add_argument("--fraction", type=A.fraction, default=0.5,
                   help="fraction of the (class-sorted) training set cached: a random "
                        "subset of it (random_subset=True), but for the -first arm "
                        "(default: %(default)s)")
    p.add_argument("--latency-ms", type=A.non_negative_float, default=2.0,
                   help="median of the EMULATED lognormal latency of the prefetching arms' "
                        "loads; 0: none (default: %(default)s)")
    p.add_argument("--p99-ratio", type=float, default=10.0, help="default: %(default)s")
    p.add_argument("--threads", type=A.positive_int, default=8,
                   help="Prefetcher threads (default: %(default)s)")
    p.add_argument("--staging-slots", type=A.positive_int, default=512,
                   help="default: %(default)s")
    p.add_argument("--lr", type=float, default=0.05, help="default: %(default)s")
    p.add_argument("--out", type=Path, default=None,
                   help="where quality.json goes (default: ./benchmark-results/"
                        "quality-<timestamp>)")


def main(args: argparse.Namespace, argv: Sequence[str],
         say: Callable[[str], None] = print) -> int:
    from . import run as R

    args.window = args.window or 4 * args.batch_size
    load_before = os.getloadavg()
    say(f"load average at the start: {' '.join(f'{x:.2f}' for x in load_before)}")
    data = load_digits_sorted()
    arms = arms_for(len(data[1]), args)
    say(f"digits: {len(data[1])} training samples sorted by class, {len(data[3])} test; "
        f"cache f = {args.fraction:g} (a random subset; the first indices for -first), batch "
        f"{args.batch_size}, W = {args.window} and {arms[-1].window}, {args.epochs} epochs, "
        f"seeds 0..{args.seeds - 1}; "
        f"prefetching arms: {args.threads} threads, EMULATED lognormal load latency median "
        f"{args.latency_ms:g} ms, p99 {args.p99_ratio:g} x")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    token = secrets.token_hex(4)
    runs = []
    t0 = time.perf_counter()
    try:
        for seed in range(args.seeds):
            for a in arms:
                r = train_arm(a, seed, data, args, f"q-{token}-{seed}-{a.name}")
                runs.append(r)
                say(f"  seed {seed} {a.name:>17}: test accuracy {100 * r['accuracy']:.2f} %")
    finally:
        torch.set_num_threads(threads)
    table, checks, text = check_lines(runs, arms, args)
    say("")
    say("\n".join(table))
    load_after = os.getloadavg()
    say(f"load average at the start: {' '.join(f'{x:.2f}' for x in load_before)}; at the end: "
        f"{' '.join(f'{x:.2f}' for x in load_after)} ({time.perf_counter() - t0:.0f} s)")
    say("target checks (measured, not asserted):")
    say("\n".join(text))
    stamp = R.timestamp_dir()
    out = args.out or stamp.with_name(f"quality-{stamp.name}")
    out.mkdir(parents=True, exist_ok=True)
    report.write_json({
        "command": " ".join(shlex.quote(a) for a in ["python", "-m", "benchmark", *argv]),
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "loadavg_before": load_before, "loadavg_after": load_after, "checks": checks,
        "runs": [{k: v for k, v in r.items() if k != "batches"} for r in runs],
    }, out / "quality.json")
    say(f"wrote {out / 'quality.json'}")
    return 0
