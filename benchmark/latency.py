"""The storage-latency scenario: ``python -m benchmark latency``.

Every read from "storage" (every cache miss, in a DataLoader worker or in the prefetcher's
threads) first sleeps for an EMULATED latency: a constant one (default 20 ms), or a heavy-tailed
one, lognormal with a chosen median (default 20 ms) and p99 = 10 x the median. Each (latency,
cached fraction f) is trained for a few epochs with four arms, side by side in one run:

- (a) the plain DataLoader as today: ``RandomSampler``, every miss loaded by the worker that
  meets it (the two-line ``__getitem__``);
- (b) the same order through ``stocaching.Prefetcher`` without a window: misses loaded ahead
  in threads, indices yielded in the base order;
- (c) ``Prefetcher(window=W, mode="fixed")``: the cache-preferring order computed at each
  epoch's start from the cache state;
- (d) ``Prefetcher(window=W, mode="adaptive")``: the same order serving what is ready now;

plus the zero-latency reference (arm (a) without latency: the limit where latency is fully
hidden and a miss costs only its decode CPU), and at one f all four arms without latency (the
CPU-bound case, where prefetching should cost nothing; its epochs are short and noisy, so it
runs ``--cpu-bound-repeats`` rounds, more than the rest).

The latencies are a pure function of (seed, epoch, index): every arm sleeps the same time for
the same sample in the same epoch. The dataset is the benchmark's JPEGs (:mod:`benchmark.data`),
smaller than the main run's so that a miss costs little CPU next to its latency, as on network
storage; the model is :class:`benchmark.model.SmallCNN`.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import multiprocessing as mp
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
from . import data as D
from . import plot, report
from . import run as R
from .model import SmallCNN

#: The arms, in the order of the table.
ARMS = ("a", "b", "c", "d")
ARM_LABELS = {"a": "plain DataLoader", "b": "plain order + Prefetcher",
              "c": "fixed window + Prefetcher", "d": "adaptive window + Prefetcher"}
PREFETCH_ARMS = ("b", "c", "d")

#: z of the 99th percentile of a standard normal: p99 / median of a lognormal is exp(sigma * z).
Z99 = statistics.NormalDist().inv_cdf(0.99)

#: Targets (issue 10), measured, never asserted.
HIDDEN_MIN = 0.90      # best arm vs the zero-latency reference, f = 0.5, 20 ms, epochs >= 2
SPEEDUP_MIN = 4.0      # best arm vs arm (a), same setting
FILL_SPEEDUP_MIN = 3.0  # the same in epoch 1, which fills the cache
TAIL_MIN = 1.2         # heavy-tailed latency: (d) vs (b)
CPU_MIN = 0.95         # no latency: every prefetching arm vs (a)
TARGET_F = 0.5

COLUMNS = [
    "config", "latency", "latency_kind", "latency_median_ms", "latency_p99_ms", "fraction",
    "arm", "arm_label", "repeat", "epoch", "epoch_time_s", "samples", "samples_per_s",
    "data_wait_s", "stall_fraction", "cpu_s", "hit_rate", "hits", "misses", "staged_hits",
    "prefetched", "loss", "slots", "staging_slots", "window", "mode", "prefetch_threads",
    "prefetch_processes",
    "lookahead", "workers", "batch_size", "start_method", "torch_threads", "num_images",
    "image_size", "decoded_size", "loadavg_1min",
]


# ----------------------------------------------------------------------------------------------
# Emulated latency
# ----------------------------------------------------------------------------------------------


def lognormal_params(median_ms: float, p99_ratio: float = 10.0) -> tuple[float, float]:
    """``(mu, sigma)`` of the lognormal (of seconds) whose median is ``median_ms`` and whose
    99th percentile is ``p99_ratio`` times the median: ``mu = ln(median)``,
    ``sigma = ln(p99_ratio) / z_0.99``."""
    if not median_ms > 0 or not p99_ratio > 1:
        raise ValueError(f"median_ms should be > 0 and p99_ratio > 1, but got "
                         f"median_ms={median_ms}, p99_ratio={p99_ratio}")
    return math.log(median_ms / 1000.0), math.log(p99_ratio) / Z99


@dataclasses.dataclass(frozen=True)
class Latency:
    """An EMULATED read latency: ``kind`` is ``none``, ``constant`` (``ms`` every read) or
    ``lognormal`` (median ``ms``, p99 ``p99_ratio`` x the median)."""

    kind: str
    ms: float = 0.0
    p99_ratio: float = 10.0

    @property
    def label(self) -> str:
        if self.kind == "none":
            return "none"
        if self.kind == "constant":
            return f"{self.ms:g} ms"
        return f"lognormal {self.ms:g} ms"

    @property
    def describe(self) -> str:
        if self.kind == "none":
            return "no added latency"
        if self.kind == "constant":
            return f"EMULATED constant read latency {self.ms:g} ms per miss"
        mu, sigma = lognormal_params(self.ms, self.p99_ratio)
        return (f"EMULATED heavy-tailed read latency per miss: lognormal, median {self.ms:g} ms, "
                f"p99 {self.p99_ms:g} ms ({self.p99_ratio:g} x median), mean "
                f"{1000 * math.exp(mu + sigma ** 2 / 2):.1f} ms (sigma {sigma:.3f})")

    @property
    def p99_ms(self) -> float:
        if self.kind == "lognormal":
            return self.ms * self.p99_ratio
        return self.ms

    def delays(self, n: int, seed: int, epoch: int) -> np.ndarray | None:
        """Seconds to sleep before reading each of the ``n`` samples in ``epoch``: a pure
        function of (seed, epoch), the same for every arm. None without latency."""
        if self.kind == "none" or self.ms <= 0:
            return None
        if self.kind == "constant":
            return np.full(n, self.ms / 1000.0)
        mu, sigma = lognormal_params(self.ms, self.p99_ratio)
        return np.random.default_rng([seed, epoch, 0x1A7]).lognormal(mu, sigma, n)


class LatencyDataset(D.JpegDataset):
    """:class:`benchmark.data.JpegDataset` whose ``load`` (phase one: read + decode) first
    sleeps ``delays[index]`` seconds, the EMULATED storage latency of the current epoch.
    ``delays`` is a tensor in shared memory, so that the processes that copied the dataset
    before an epoch began (the Prefetcher's loader processes, persistent workers) sleep that
    epoch's values too: set them with :meth:`set_delays` before each epoch's
    ``iter(loader)``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.delays = torch.zeros(self.num_images, dtype=torch.float64).share_memory_()

    def set_delays(self, delays: np.ndarray | None) -> None:
        """This epoch's latencies in seconds, one per index (None: no latency)."""
        if delays is None:
            self.delays.zero_()
        else:
            self.delays.copy_(torch.from_numpy(np.asarray(delays, dtype=np.float64)))

    def load(self, index: int) -> torch.Tensor:
        delay = float(self.delays[index])
        if delay > 0:
            time.sleep(delay)
        with open(D.image_path(self.root, index), "rb") as f:
            data = f.read()
        return D.decode(data, self.decoded_size)


# ----------------------------------------------------------------------------------------------
# Options and configurations
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Options:
    data_dir: Path | None
    num_images: int
    image_size: int
    decoded_size: int
    num_classes: int
    fractions: list[float]
    latency_ms: float
    tail_median_ms: float
    p99_ratio: float
    epochs: int
    workers: int
    batch_size: int
    start_method: str
    prefetch_threads: int
    window: int
    lookahead: int
    staging_slots: int
    torch_threads: int
    repeats: int
    seed: int
    lr: float
    prefetch_processes: int = 2
    cpu_bound_only: bool = False
    cpu_bound_repeats: int = 0  # rounds of the configurations without latency, at least repeats


@dataclasses.dataclass(frozen=True)
class Config:
    latency: Latency
    fraction: float
    arm: str

    @property
    def name(self) -> str:
        return f"{self.latency.label} f={self.fraction:g} ({self.arm})"


def configs_for(opts: Options) -> list[Config]:
    """The grid, f by f so that the arms compared in a target run close together in time:
    arm (a) without latency (the zero-latency reference; at f = 0.5 also the prefetching arms,
    the CPU-bound check), then the four arms under the constant latency, then under the
    heavy-tailed one."""
    lats = [Latency("constant", opts.latency_ms),
            Latency("lognormal", opts.tail_median_ms, opts.p99_ratio)]
    out = []
    for f in opts.fractions:
        out += [Config(Latency("none"), f, arm)
                for arm in (ARMS if abs(f - TARGET_F) < 1e-9 else ("a",))]
        if not opts.cpu_bound_only:
            out += [Config(lat, f, arm) for lat in lats for arm in ARMS]
    return out


def _gib(slots: int, staging: int, n: int, slot_bytes: int) -> float:
    """size_limit_gib that buys ``slots`` slots and ``staging`` staging slots (the documented
    rule: slots, staging slots and one aux byte per sample; half a byte of slack)."""
    return ((slots + staging) * slot_bytes + n + 0.5) / R.GIB


def _make_cache(opts: Options, cfg: Config, name: str) -> Any:
    """The arm's cache: f of the dataset, plus staging slots for a prefetching arm. Arm (a)
    at f = 0 has no cache (the no-cache loader of today); a prefetching arm at f = 0 has a
    cache of staging slots only."""
    n, d = opts.num_images, opts.decoded_size
    slots = min(n, round(cfg.fraction * n))
    staging = opts.staging_slots if cfg.arm in PREFETCH_ARMS else 0
    if slots == 0 and staging == 0:
        return None
    with warnings.catch_warnings():
        # "leaves no slots ... every get_slot will miss": not so with staging slots at f = 0.
        warnings.filterwarnings("ignore", message=".*leaves no slots.*")
        cache = stocaching.SharedCache(_gib(slots, staging, n, 3 * d * d), n, (3, d, d),
                                       torch.uint8, name=name, staging_slots=staging)
    if len(cache) != slots:
        raise RuntimeError(f"the cache got {len(cache)} slots where the sizing rule gives "
                           f"{slots}")
    return cache


def _sampler(opts: Options, cfg: Config, ds: LatencyDataset, cache: Any) -> Any:
    base = torch.utils.data.RandomSampler(ds, generator=torch.Generator().manual_seed(opts.seed))
    if cfg.arm == "a":
        return base
    window = None if cfg.arm == "b" else opts.window
    mode = "fixed" if cfg.arm == "c" else "adaptive"
    return stocaching.Prefetcher(base, cache, ds.load, window=window, mode=mode,
                                 threads=opts.prefetch_threads, lookahead=opts.lookahead,
                                 processes=opts.prefetch_processes)


def run_config(opts: Options, cfg: Config, root: Path, name: str, repeat: int,
               say: Callable[[str], None]) -> list[dict[str, Any]]:
    """Train ``opts.epochs`` epochs of a new model with one (latency, f, arm); one row per
    epoch."""
    n = opts.num_images
    cache = _make_cache(opts, cfg, name)
    ds = LatencyDataset(root, n, opts.decoded_size, opts.num_classes, cache=cache)
    torch.manual_seed(opts.seed)  # the same initial model and augmentations in every arm
    sampler = _sampler(opts, cfg, ds, cache)
    loader = torch.utils.data.DataLoader(ds, batch_size=opts.batch_size, sampler=sampler,
                                         num_workers=opts.workers, drop_last=False,
                                         **({"multiprocessing_context": opts.start_method}
                                            if opts.workers else {}))
    model = SmallCNN(opts.num_classes)
    opt = torch.optim.SGD(model.parameters(), lr=opts.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    rows = []
    try:
        for epoch in range(1, opts.epochs + 1):
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch - 1)
            ds.set_delays(cfg.latency.delays(n, opts.seed, epoch))
            load1 = os.getloadavg()[0]
            s0 = cache.stats() if cache is not None else None
            loaded0 = getattr(sampler, "loaded", 0)
            elapsed, wait, seen, hits, loss, cpu = R._train_epoch(loader, model, opt, loss_fn)
            st = cache.stats(since=s0) if cache is not None else None
            row = {
                "config": cfg.name, "latency": cfg.latency.label,
                "latency_kind": cfg.latency.kind, "latency_median_ms": cfg.latency.ms,
                "latency_p99_ms": cfg.latency.p99_ms, "fraction": cfg.fraction,
                "arm": cfg.arm, "arm_label": ARM_LABELS[cfg.arm], "repeat": repeat,
                "epoch": epoch, "epoch_time_s": elapsed, "samples": seen,
                "samples_per_s": seen / elapsed if elapsed > 0 else None,
                "data_wait_s": wait, "stall_fraction": wait / elapsed if elapsed else None,
                "cpu_s": cpu, "loss": loss,
                "hit_rate": None if st is None else st["hit_rate"],
                "hits": None if st is None else st["hits"],
                "misses": None if st is None else st["misses"],
                "staged_hits": None if st is None else st["staged_hits"],
                "prefetched": getattr(sampler, "loaded", 0) - loaded0 if cfg.arm != "a" else 0,
                "slots": None if cache is None else len(cache),
                "staging_slots": None if cache is None else cache.stats()["staging_slots"],
                "window": opts.window if cfg.arm in ("c", "d") else None,
                "mode": {"c": "fixed", "d": "adaptive"}.get(cfg.arm),
                "prefetch_threads": opts.prefetch_threads if cfg.arm != "a" else None,
                "prefetch_processes": opts.prefetch_processes if cfg.arm != "a" else None,
                "lookahead": opts.lookahead if cfg.arm != "a" else None,
                "workers": opts.workers, "batch_size": opts.batch_size,
                "start_method": opts.start_method, "torch_threads": torch.get_num_threads(),
                "num_images": n, "image_size": opts.image_size,
                "decoded_size": opts.decoded_size, "loadavg_1min": load1,
            }
            rows.append(row)
            hr = "-" if row["hit_rate"] is None else f"{row['hit_rate']:.3f}"
            say(f"  {cfg.name:>26} epoch {epoch}/{opts.epochs}: {elapsed:6.2f} s, "
                f"{row['samples_per_s']:7,.0f} samples/s, hit rate {hr}, "
                f"prefetched {row['prefetched']}, stall {100 * row['stall_fraction']:3.0f}%, "
                f"load {load1:.2f}")
    finally:
        if hasattr(sampler, "close"):
            sampler.close()  # the Prefetcher's loader processes, if any
        loader = sampler = None
        ds.cache = None
        if cache is not None:
            cache.close()
    return rows


# ----------------------------------------------------------------------------------------------
# Table and target checks
# ----------------------------------------------------------------------------------------------


def _agg(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians over repeats, one row per (config, epoch)."""
    return report.aggregate(rows)


def _pick(agg: Sequence[dict[str, Any]], kind: str, f: float, arm: str) -> list[dict[str, Any]]:
    return sorted((r for r in agg if r["latency_kind"] == kind and r["arm"] == arm
                   and abs(r["fraction"] - f) < 1e-9), key=lambda r: r["epoch"])


def _later(rs: Sequence[dict[str, Any]]) -> float | None:
    """Samples/s: median of epochs >= 2 (epoch 1 alone when there is no other)."""
    vals = [r["samples_per_s"] for r in rs if r["epoch"] >= 2] or \
        [r["samples_per_s"] for r in rs]
    return statistics.median(vals) if vals else None


def _first(rs: Sequence[dict[str, Any]]) -> float | None:
    return next((r["samples_per_s"] for r in rs if r["epoch"] == 1), None)


def _whole(rs: Sequence[dict[str, Any]]) -> float | None:
    """Samples/s over all epochs: total samples / total time."""
    t = sum(r["epoch_time_s"] for r in rs)
    return sum(r["samples"] for r in rs) / t if rs and t > 0 else None


def _check(name: str, ok: bool | None, measured: float | None, target: str,
           detail: str, minimum: float) -> dict[str, Any]:
    return {"name": name, "status": "n/a" if ok is None else ("PASS" if ok else "MISS"),
            "measured": measured, "target": target, "detail": detail, "minimum": minimum}


def check_targets(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The targets of the latency scenario, measured on ``rows`` (never asserted), round by
    round: a round (``--repeats``) runs every arm once, the reference included, so each round
    gives each target one ratio of figures measured minutes apart, and the target is judged on
    the median of the rounds' ratios. Each check: ``name``, ``status`` (PASS or MISS, of the
    median; n/a), ``measured`` (the median ratio), ``target``, ``detail`` (the two figures of
    the median round), ``rounds`` (every round's ratio) and ``rounds_met``."""
    by_round: dict[Any, list[dict[str, Any]]] = {}
    for r in rows:
        by_round.setdefault(r.get("repeat") or 1, []).append(r)
    per_round = [_checks_of_round(rs) for _, rs in sorted(by_round.items())]
    out = []
    for every in itertools.zip_longest(*per_round):
        # (rounds beyond --repeats run the CPU-bound configurations alone: the other
        # targets are judged on the rounds that measured them)
        same = [c for c in every if c is not None and c["measured"] is not None]
        if not same:
            first = next(c for c in every if c is not None)
            out.append({**first, "rounds": [None] * len(every), "rounds_met": None})
            continue
        ratios = [c["measured"] for c in same]
        if "arms" in same[0] and all("arms" in c for c in same):
            out.append(_every_arm(same))
            continue
        med = statistics.median(ratios)
        # the detail of the round whose ratio is nearest the median (the median itself when
        # the count is odd)
        mid = min(same, key=lambda c: abs(c["measured"] - med))
        met = sum(x >= same[0]["minimum"] for x in ratios)
        out.append({**mid, "status": "PASS" if med >= same[0]["minimum"] else "MISS",
                    "measured": med, "rounds": ratios, "rounds_met": met})
    return out


def _every_arm(same: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A target every prefetching arm must meet (the CPU-bound one), over rounds: each
    arm's median ratio over the rounds, and the target judged on the lowest of those, with
    that arm's rounds as the spread. (The lowest arm of each round, as before, takes the
    minimum of three noisy ratios: on the 2-core machine it sat a few points under every
    arm's own median.)"""
    arms = sorted(set.intersection(*(set(c["arms"]) for c in same)))
    per_arm = {a: [c["arms"][a] / c["reference"] for c in same] for a in arms}
    medians = {a: statistics.median(v) for a, v in per_arm.items()}
    worst = min(arms, key=medians.__getitem__)
    lo, ratios = same[0]["minimum"], per_arm[worst]
    mid = min(same, key=lambda c: abs(c["arms"][worst] / c["reference"] - medians[worst]))
    how = f" by its median over {len(same)} rounds" if len(same) > 1 else ""
    refs = [c["reference"] for c in same]
    own = (f"; (a) itself moved {min(refs):,.0f}-{max(refs):,.0f} samples/s between rounds "
           f"(+-{50 * (max(refs) - min(refs)) / statistics.median(refs):.0f} %)"
           if len(same) > 1 else "")
    detail = (f"slowest prefetching arm{how}: ({worst}) {medians[worst]:.3f} x arm (a) "
              f"({', '.join(f'({a}) {medians[a]:.3f}' for a in arms)}); "
              f"{mid['arms'][worst]:,.0f} vs (a) {mid['reference']:,.0f} samples/s "
              f"({mid['setting']}{', its median round' if how else ''}){own}")
    return {**mid, "status": "PASS" if medians[worst] >= lo else "MISS",
            "measured": medians[worst], "detail": detail, "rounds": ratios,
            "rounds_met": sum(x >= lo for x in ratios)}


def _checks_of_round(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The targets measured on the rows of one round."""
    agg = _agg(rows)
    f = TARGET_F
    out = []
    const = next((r["latency"] for r in agg if r["latency_kind"] == "constant"), "20 ms")
    tail = next((r["latency"] for r in agg if r["latency_kind"] == "lognormal"), "lognormal")

    def best(kind: str, value: Callable[[Sequence[dict[str, Any]]], float | None]
             ) -> tuple[str | None, float | None]:
        cand = [(arm, value(_pick(agg, kind, f, arm))) for arm in PREFETCH_ARMS]
        cand = [(a, v) for a, v in cand if v is not None]
        return max(cand, key=lambda c: c[1]) if cand else (None, None)

    def ratio_line(name: str, x: float | None, y: float | None, lo: float, xl: str, yl: str,
                   how: str) -> dict[str, Any]:
        if x is None or y is None:
            return _check(name, None, None, f">= {lo:g} x", f"needs {xl} and {yl} ({how})", lo)
        r = x / y
        return _check(name, r >= lo, r, f">= {lo:g} x",
                      f"{xl} {x:,.0f} vs {yl} {y:,.0f} samples/s ({how}): {r:.2f} x", lo)

    arm, b = best("constant", _later)
    ref = _later(_pick(agg, "none", f, "a"))
    a = _later(_pick(agg, "constant", f, "a"))
    out.append(ratio_line("hidden", b, ref, HIDDEN_MIN, f"best arm ({arm})",
                          "zero-latency reference", f"f = {f:g}, {const}, epochs >= 2"))
    out.append(ratio_line("speed-up", b, a, SPEEDUP_MIN, f"best arm ({arm})", "arm (a)",
                          f"f = {f:g}, {const}, epochs >= 2"))
    arm1, b1 = best("constant", _first)
    a1 = _first(_pick(agg, "constant", f, "a"))
    out.append(ratio_line("fill speed-up", b1, a1, FILL_SPEEDUP_MIN, f"best arm ({arm1})",
                          "arm (a)", f"f = {f:g}, {const}, epoch 1, cache filling"))
    d = _later(_pick(agg, "lognormal", f, "d"))
    bb = _later(_pick(agg, "lognormal", f, "b"))
    out.append(ratio_line("tail", d, bb, TAIL_MIN, "(d)", "(b)",
                          f"f = {f:g}, {tail}, epochs >= 2"))
    a0 = _whole(_pick(agg, "none", f, "a"))
    low = [(arm, _whole(_pick(agg, "none", f, arm))) for arm in PREFETCH_ARMS]
    low = [(x, v) for x, v in low if v is not None]
    if a0 is None or not low:
        out.append(_check("cpu-bound", None, None, f">= {CPU_MIN:g} x",
                          "needs the four arms without latency", CPU_MIN))
    else:
        arm0, v0 = min(low, key=lambda c: c[1])
        rest = ", ".join(f"({x}) {v / a0:.2f}" for x, v in low)

        def cpu(arm: str) -> float:
            return sum(r["cpu_s"] or 0.0 for r in _pick(agg, "none", f, arm))

        rest += (f"; CPU seconds of the epochs: ({arm0}) {cpu(arm0):.2f} vs (a) {cpu('a'):.2f}"
                 if cpu("a") else "")
        out.append({**_check("cpu-bound", v0 / a0 >= CPU_MIN, v0 / a0, f">= {CPU_MIN:g} x",
                             f"slowest prefetching arm ({arm0}) {v0:,.0f} vs arm (a) "
                             f"{a0:,.0f} samples/s (f = {f:g}, no latency, epochs 1-"
                             f"{max(r['epoch'] for r in agg)} together): {v0 / a0:.2f} x "
                             f"[{rest}]", CPU_MIN),
                    "arms": dict(low), "reference": a0,
                    "setting": f"f = {f:g}, no latency, epochs 1-{max(r['epoch'] for r in agg)} "
                               f"together"})
    return out


CHECK_NAMES = {
    "hidden": "1a. latency hidden: best arm vs zero-latency reference",
    "speed-up": "1b. best arm vs plain DataLoader (a)",
    "fill speed-up": "2. epoch 1 (cache filling): best arm vs (a)",
    "tail": "3. heavy-tailed latency: adaptive (d) vs plain order + Prefetcher (b)",
    "cpu-bound": "4. no latency (CPU-bound): every prefetching arm vs (a)",
}


def format_checks(checks: Sequence[dict[str, Any]]) -> str:
    """One line a target: its status (of the median over rounds), the figures of the median
    round and, with several rounds, the median, the spread and how many rounds met it."""
    lines = []
    for c in checks:
        rounds = c.get("rounds") or []
        spread = ""
        if len(rounds) > 1 and c.get("rounds_met") is not None:
            spread = (f"; median of {len(rounds)} rounds {c['measured']:.2f} x, rounds "
                      f"{', '.join(f'{x:.2f}' for x in rounds)} (spread "
                      f"{min(rounds):.2f}-{max(rounds):.2f}), met in {c['rounds_met']} of "
                      f"{len(rounds)}")
        lines.append(f"[{c['status']}] {CHECK_NAMES.get(c['name'], c['name'])}, target "
                     f"{c['target']}: {c['detail']}{spread}")
    return "\n".join(lines)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """Samples/s per (latency, f, arm) and epoch, with the hit rate (``cache.stats()``) and
    how many samples the prefetcher loaded (medians over repeats)."""
    agg = _agg(rows)
    epochs = sorted({r["epoch"] for r in agg})
    rank = {"constant": 0, "lognormal": 1, "none": 2}
    keys = sorted({(r["latency"], r["fraction"], r["arm"]): rank.get(r["latency_kind"], 3)
                   for r in agg}.items(), key=lambda kv: (kv[1], kv[0][1], kv[0][2]))
    head = ["latency (EMULATED)", "f", "arm"]
    for e in epochs:
        head += [f"e{e} samples/s", f"e{e} hit"]
    head += ["cpu s/epoch", "prefetched", "arm"]
    body = []
    for (lat, f, arm), _ in keys:
        rs = {r["epoch"]: r for r in agg if (r["latency"], r["fraction"], r["arm"]) ==
              (lat, f, arm)}
        line = [lat, f"{f:g}", f"({arm})"]
        for e in epochs:
            r = rs.get(e)
            line += [report._fmt(r and r["samples_per_s"], ",.0f"),
                     report._fmt(r and r["hit_rate"], ".3f")]
        pre = [r.get("prefetched") for r in rs.values() if r.get("prefetched") is not None]
        cpu = [r["cpu_s"] for e, r in rs.items() if e >= 2 and r.get("cpu_s") is not None] or \
            [r["cpu_s"] for r in rs.values() if r.get("cpu_s") is not None]
        line += [report._fmt(statistics.median(cpu) if cpu else None, ".2f"),
                 str(sum(pre)) if pre and arm != "a" else "-", ARM_LABELS[arm]]
        body.append(line)
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h)
              for i, h in enumerate(head)]
    left = {0, len(head) - 1}

    def fmt(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    lines = [fmt(head), "  ".join("-" * w for w in widths)] + [fmt(b) for b in body]
    lines.append("(hit: cache.stats() hit rate of the epoch, staged samples included; cpu s/epoch: "
                 "CPU seconds of the trainer and its workers, median of epochs >= 2, which move "
                 "much less than wall time when other programs share the cores; prefetched: "
                 "samples the Prefetcher loaded, all epochs)")
    reps = sorted({r["repeats"] for r in agg}) or [1]
    if len(reps) > 1:
        lines.append(f"(medians of {reps[0]} repeats, {reps[-1]} for the configurations without "
                     f"latency at f = {TARGET_F:g} (the CPU-bound check's extra rounds); every "
                     f"repeat is in the CSV)")
    elif reps[0] > 1:
        lines.append(f"(medians of {reps[0]} repeats; every repeat is in the CSV)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Plot
# ----------------------------------------------------------------------------------------------


def make_plot(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """One panel per latency: samples/s against f, one line per arm (median of epochs >= 2,
    solid; epoch 1, which fills the cache, dotted), the zero-latency reference dashed."""
    plt = plot._pyplot()
    agg = _agg(rows)
    lats = [k for k in ("constant", "lognormal", "none") if any(r["latency_kind"] == k
                                                                 for r in agg)]
    fig, axes = plt.subplots(1, len(lats), figsize=(5.0 * len(lats), 4.6), dpi=110,
                             sharey=True, squeeze=False)
    colours = {"a": "tab:gray", "b": "tab:blue", "c": "tab:orange", "d": "tab:green"}
    ref = sorted({(r["fraction"], None) for r in agg})
    ref_pts = [(f, _later(_pick(agg, "none", f, "a"))) for f, _ in ref]
    ref_pts = [(f, v) for f, v in ref_pts if v is not None]
    for ax, kind in zip(axes[0], lats):
        title = next(r["latency"] for r in agg if r["latency_kind"] == kind)
        for arm in ARMS:
            pts = sorted({r["fraction"] for r in agg if r["latency_kind"] == kind
                          and r["arm"] == arm})
            if not pts:
                continue
            later = [_later(_pick(agg, kind, f, arm)) for f in pts]
            first = [_first(_pick(agg, kind, f, arm)) for f in pts]
            ax.plot(pts, later, marker="o", color=colours[arm],
                    label=f"({arm}) {ARM_LABELS[arm]}")
            if kind != "none":
                ax.plot(pts, first, marker=".", linestyle=":", color=colours[arm])
        if ref_pts and kind != "none":
            ax.plot([p[0] for p in ref_pts], [p[1] for p in ref_pts], color="black",
                    linestyle="--", linewidth=1.2, label="zero-latency reference (a)")
        ax.set_title("no latency" if kind == "none" else f"EMULATED latency: {title}"
                     + (" (p99 = 10 x median)" if kind == "lognormal" else ""), fontsize=9)
        ax.set_xlabel("fraction f of the dataset cached")
        ax.set_xlim(-0.05, 1.05)
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("samples/s (solid: epochs >= 2, dotted: epoch 1)")
    axes[0][0].legend(loc="upper left", fontsize=7)
    top = max((r["samples_per_s"] for r in agg if r.get("samples_per_s")), default=1.0)
    axes[0][0].set_ylim(0, 1.08 * top)
    r0 = rows[0]
    pf = next((r for r in rows if r.get("prefetch_threads")), {})
    fig.suptitle(f"{r0['num_images']} JPEGs {r0['image_size']}px -> cached "
                 f"{r0['decoded_size']}px, {r0['workers']} workers, batch {r0['batch_size']}; "
                 f"Prefetcher threads={pf.get('prefetch_threads', '-')}, lookahead="
                 f"{pf.get('lookahead', '-')}, window of (c), (d) = "
                 f"{next((r['window'] for r in rows if r.get('window')), '-')}", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:

    d = p.add_argument_group("dataset (generated once, then reused)")
    d.add_argument("--data-dir", type=Path, default=None,
                   help="where the JPEGs live (default: ~/.cache/stocaching-benchmark/<params>)")
    d.add_argument("--num-images", type=A.positive_int, default=1500,
                   help="dataset size (default: %(default)s)")
    d.add_argument("--image-size", type=A.positive_int, default=128,
                   help="side of the source JPEGs: the decode cost of a miss "
                        "(default: %(default)s)")
    d.add_argument("--decoded-size", type=A.positive_int, default=64,
                   help="side of the decoded uint8 image that is cached (default: %(default)s)")
    p.add_argument("--cache-fraction", type=A.fraction, nargs="+", default=[0.0, 0.5, 1.0],
                   help="fractions f of the dataset cached (default: %(default)s; the targets "
                        "need 0.5)")
    p.add_argument("--latency-ms", type=A.non_negative_float, default=20.0,
                   help="EMULATED constant read latency per miss (default: %(default)s)")
    p.add_argument("--tail-median-ms", type=A.non_negative_float, default=20.0,
                   help="median of the EMULATED heavy-tailed (lognormal) latency; its p99 is "
                        "--p99-ratio times that (default: %(default)s)")
    p.add_argument("--p99-ratio", type=float, default=10.0, help="default: %(default)s")
    p.add_argument("--epochs", type=A.positive_int, default=3, help="default: %(default)s")
    p.add_argument("--workers", type=A.non_negative_int, default=2,
                   help="DataLoader workers (default: %(default)s)")
    p.add_argument("--batch-size", type=A.positive_int, default=64, help="default: %(default)s")
    p.add_argument("--threads", type=A.positive_int, default=32,
                   help="Prefetcher threads: loads in flight (default: %(default)s, by Little's "
                        "law about twice the reads in flight at 1,500 samples/s, f = 0.5 and "
                        "a 32.6 ms mean latency)")
    p.add_argument("--prefetch-processes", type=A.non_negative_int, default=2,
                   help="Prefetcher processes: load in this many processes, each with --threads "
                        "threads; 0 loads in threads of the trainer (default: %(default)s: the "
                        "loads decode JPEGs, and in the trainer's threads they share its GIL "
                        "and core)")
    p.add_argument("--cpu-bound-only", action="store_true",
                   help="run only the configurations without latency (the CPU-bound check)")
    p.add_argument("--window", type=A.positive_int, default=None,
                   help="W of arms (c) and (d) (default: 4 batches, so that window + lookahead "
                        "covers the consumption rate x the p99 latency: 256 + 256 = 512 "
                        "positions with the default processes and threads, against 1,500 "
                        "samples/s x 200 ms = 300)")
    p.add_argument("--lookahead", type=A.positive_int, default=None,
                   help="Prefetcher lookahead (default: the Prefetcher's, 4 x the loads in flight)")
    p.add_argument("--staging-slots", type=A.positive_int, default=None,
                   help="staging slots of the prefetching arms' caches (default: 2 x "
                        "(window + lookahead))")
    p.add_argument("--torch-threads", type=A.positive_int, default=None,
                   help="torch threads of the training process (default: cores minus "
                        "workers, at least 1)")
    p.add_argument("--repeats", type=A.positive_int, default=3,
                   help="rounds: run the whole grid this many times, every arm once a round "
                        "(odd rounds in reverse order); each target is checked on the median "
                        "of the rounds' ratios, with their spread; tables and plot use medians "
                        "(default: %(default)s)")
    p.add_argument("--cpu-bound-repeats", type=A.positive_int, default=None,
                   help="rounds of the configurations without latency (the CPU-bound check), "
                        "at least --repeats: those beyond run them alone. Their epochs last "
                        "about a second on 2 cores and move by +-15 %% from round to round, so "
                        "the median of 3 rounds cannot tell 0.95 x from 1.0 x (default: 3 x "
                        "--repeats)")
    p.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    p.add_argument("--lr", type=float, default=0.05, help="default: %(default)s")
    p.add_argument("--out", type=Path, default=None,
                   help="output directory (default: ./benchmark-results/latency-<timestamp>)")
    p.add_argument("--no-plot", dest="plot", action="store_false", help="skip the PNG")


def options_from(args: argparse.Namespace) -> Options:
    window = args.window or 4 * args.batch_size
    lookahead = args.lookahead or 4 * args.threads * max(1, args.prefetch_processes)
    return Options(
        data_dir=args.data_dir, num_images=args.num_images, image_size=args.image_size,
        decoded_size=args.decoded_size, num_classes=10,
        fractions=sorted(set(args.cache_fraction)), latency_ms=args.latency_ms,
        tail_median_ms=args.tail_median_ms, p99_ratio=args.p99_ratio, epochs=args.epochs,
        workers=args.workers, batch_size=args.batch_size,
        start_method=mp.get_all_start_methods()[0], prefetch_threads=args.threads,
        window=window, lookahead=lookahead,
        staging_slots=args.staging_slots or 2 * (window + lookahead),
        torch_threads=args.torch_threads or R.default_threads(args.workers, 1),
        repeats=args.repeats, seed=args.seed, lr=args.lr,
        prefetch_processes=args.prefetch_processes, cpu_bound_only=args.cpu_bound_only,
        cpu_bound_repeats=max(args.repeats, args.cpu_bound_repeats or 3 * args.repeats))


def write_csv(rows: Sequence[dict[str, Any]], path: Path) -> None:
    report.write_csv(rows, path, columns=COLUMNS)


def main(args: argparse.Namespace, argv: Sequence[str],
         say: Callable[[str], None] = print) -> int:
    opts = options_from(args)
    stamp = R.timestamp_dir()
    out = args.out or stamp.with_name(f"latency-{stamp.name}")
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    cores = os.cpu_count() or 1
    say(f"load average at the start: {' '.join(f'{x:.2f}' for x in load_before)} "
        f"(1, 5, 15 min; {cores} cores)")
    lats = [Latency("constant", opts.latency_ms),
            Latency("lognormal", opts.tail_median_ms, opts.p99_ratio)]
    note = ("NOTE: EMULATED storage latency (a sleep before every read from disk, in a worker or "
            "a prefetcher thread), not measured storage: " + "; ".join(x.describe for x in lats))
    say(note)
    root = opts.data_dir or D.default_data_dir(opts.num_images, opts.image_size, 90, opts.seed,
                                               opts.num_classes)
    _, gen_s = D.ensure_dataset(root, opts.num_images, opts.image_size, quality=90,
                                seed=opts.seed, num_classes=opts.num_classes)
    ws, nbytes = D.warm_page_cache(root, opts.num_images)
    say(f"dataset: {opts.num_images} JPEGs of {opts.image_size}x{opts.image_size} -> cached "
        f"uint8 3x{opts.decoded_size}x{opts.decoded_size} in {root}"
        + (f" (generated in {gen_s:.1f} s)" if gen_s else " (reused)")
        + f"; page cache warmed ({nbytes / R.MIB:.0f} MiB)")
    say(f"loader: {opts.workers} workers ({opts.start_method}), batch {opts.batch_size}, "
        f"RandomSampler(seed={opts.seed}), {opts.torch_threads} trainer thread(s); "
        f"Prefetcher threads={opts.prefetch_threads}, processes={opts.prefetch_processes}, "
        f"lookahead={opts.lookahead}, "
        f"window={opts.window} ((c), (d)); staging_slots={opts.staging_slots} "
        f"(prefetching arms)")
    threads = torch.get_num_threads()
    torch.set_num_threads(opts.torch_threads)
    t0 = time.perf_counter()
    try:
        R.warm_up(R.Options(data_dir=root, num_images=opts.num_images,
                            image_size=opts.image_size, decoded_size=opts.decoded_size,
                            jpeg_quality=90, num_classes=opts.num_classes, epochs=1,
                            threads=opts.torch_threads, lr=opts.lr, seed=opts.seed,
                            warm_page_cache=False, gen_processes=None),
                  R.Setup(workers=opts.workers, batch_size=opts.batch_size,
                          start_method=opts.start_method, persistent_workers=False,
                          sampler="random", get_slot="copy", read_latency_ms=0.0),
                  Path(root), R.Dist())
        grid = configs_for(opts)
        token = secrets.token_hex(4)
        rows: list[dict[str, Any]] = []
        cpu_bound = [(k, c) for k, c in enumerate(grid)
                     if c.latency.kind == "none" and abs(c.fraction - TARGET_F) < 1e-9]
        # (without f = 0.5 there is no CPU-bound check, and no extra rounds for it)
        rounds = max(opts.repeats, opts.cpu_bound_repeats if cpu_bound else 0)
        for rep in range(rounds):
            # the CPU-bound check's extra rounds run its configurations alone
            order = list(enumerate(grid)) if rep < opts.repeats else list(cpu_bound)
            if rep % 2:
                order.reverse()
            if rounds > 1:
                say(f"repeat {rep + 1}/{rounds}"
                    + (" (configurations in reverse order)" if rep % 2 else "")
                    + (" (only the CPU-bound check's)" if rep >= opts.repeats else ""))
            for k, cfg in order:
                rows += run_config(opts, cfg, Path(root), f"lat-{token}-{rep}-{k}", rep + 1, say)
                write_csv(rows, out / "latency.csv")  # a partial run is still usable
    finally:
        torch.set_num_threads(threads)
    elapsed = time.perf_counter() - t0
    load_after = os.getloadavg()
    checks = check_targets(rows)
    say("")
    say(note)
    say(format_table(rows))
    say("")
    say(f"load average at the start: {' '.join(f'{x:.2f}' for x in load_before)}; at the end: "
        f"{' '.join(f'{x:.2f}' for x in load_after)} (1, 5, 15 min; {cores} cores)")
    say(f"target checks (EMULATED latency; measured, not asserted; {elapsed:.0f} s of runs):")
    say(format_checks(checks))
    plots = [make_plot(rows, out / "latency.png")] if args.plot else []
    report.write_json({
        "command": " ".join(shlex.quote(a) for a in ["python", "-m", "benchmark", *argv]),
        "note": note, "options": {k: (str(v) if isinstance(v, Path) else v)
                                  for k, v in dataclasses.asdict(opts).items()},
        "latencies": [dataclasses.asdict(x) | {"describe": x.describe} for x in lats],
        "data_dir": str(root), "generate_s": gen_s, "elapsed_s": elapsed,
        "loadavg_before": load_before, "loadavg_after": load_after,
        "environment": R.environment(), "checks": checks, "rows": rows,
    }, out / "latency.json")
    say(f"wrote {', '.join(str(p) for p in [out / 'latency.csv', out / 'latency.json', *plots])}")
    return 0
