"""Rows, files and text: the CSV/JSON formats, the printed table and the target checks.

One row per (configuration, epoch). The columns in :data:`GROUP_FIELDS` say which loader setup a
row belongs to: a ``run`` has one group, a ``sweep`` one per grid point. Every analysis (table,
checks, plots) is done per group, from rows alone, so ``analyze`` can redo it from any CSV.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path
from typing import Any, Iterable, Sequence

#: Columns of the CSV, in order. ``hit_rate``/``hits``/``misses`` are deltas of
#: ``cache.stats()`` over the epoch (summed over nodes); ``bench_hits`` counts the samples the
#: Dataset got from the cache, per rank (``rank_hit_rates``), as a cross-check.
COLUMNS = [
    "config", "kind", "requested", "cache_gib", "slots", "cached_pct", "repeat", "epoch",
    "epoch_time_s", "samples", "samples_per_s", "data_wait_s", "stall_fraction", "cpu_s",
    "hit_rate", "hits", "misses", "writes", "bench_hits", "rank_hit_rates", "loss",
    "shm_construct_bytes", "cache_bytes",
    "workers", "batch_size", "start_method", "persistent_workers", "sampler", "sampler_used",
    "get_slot", "read_latency_ms", "world_size", "threads",
    "num_images", "image_size", "decoded_size", "sizes", "loader", "device",
]

#: The loader setup a row belongs to (one line per group in a sweep's plots). ``sampler`` is
#: the one asked for; ``sampler_used`` differs for the baselines of a cache-aware run (they have
#: no cache to be aware of, so they use the random sampler).
GROUP_FIELDS = ["workers", "batch_size", "start_method", "persistent_workers", "sampler",
                "get_slot", "read_latency_ms", "world_size", "threads", "num_images",
                "image_size", "decoded_size", "sizes", "loader", "device"]

_INT = {"slots", "repeat", "repeats", "epoch", "samples", "hits", "misses", "writes", "bench_hits",
        "shm_construct_bytes", "cache_bytes", "workers", "batch_size", "world_size", "threads",
        "num_images", "image_size", "decoded_size"}
_FLOAT = {"cpu_s", "cache_gib", "cached_pct", "epoch_time_s", "samples_per_s", "data_wait_s",
          "stall_fraction", "hit_rate", "loss", "read_latency_ms"}
_BOOL = {"persistent_workers"}

LINEARITY_TOL = 0.10
THROUGHPUT_MIN = 0.90
FILL_OVERHEAD_MAX = 0.05
TIER_VS_DECODED_MIN = 2.0  # issue 38: 50 % in /dev/shm + the rest on the disk tier, epochs >= 2,
TIER_VS_SHM_MIN = 0.8  # against 50 % cached and the rest decoded, and against 100 % in /dev/shm
TIER_SUFFIX = " + disk tier"  # the label of a tiered arm: "cache 50% + disk tier"


# ----------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ""
    if isinstance(v, (list, tuple)):
        return ";".join(_cell(x) for x in v)
    return str(v)


def write_csv(rows: Iterable[dict[str, Any]], path: str | Path,
              columns: Sequence[str] = COLUMNS) -> None:
    """``rows`` as CSV with ``columns`` (default: the training benchmark's :data:`COLUMNS`)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: _cell(r.get(k)) for k in columns})


def read_csv(path: str | Path) -> list[dict[str, Any]]:
    """Read a CSV written by :func:`write_csv` back into typed rows (empty cells -> None)."""
    rows = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in ("config", "kind", "cached_pct", "epoch", "epoch_time_s")
                   if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path} is not a benchmark CSV: it has no column(s) {missing}")
        for raw in reader:
            r: dict[str, Any] = {}
            for k, v in raw.items():
                if v is None or v == "":
                    r[k] = None
                elif k in _INT:
                    r[k] = int(float(v))
                elif k in _FLOAT:
                    r[k] = float(v)
                elif k in _BOOL:
                    r[k] = v in ("True", "true", "1")
                elif k == "rank_hit_rates":
                    r[k] = [float(x) if x else None for x in v.split(";")]
                else:
                    r[k] = v
            rows.append(r)
    return rows


def write_json(obj: Any, path: str | Path) -> None:
    def default(o: Any) -> Any:
        return str(o)

    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=default)
        f.write("\n")


# ----------------------------------------------------------------------------------------------
# Grouping
# ----------------------------------------------------------------------------------------------


def group_key(row: dict[str, Any]) -> tuple:
    return tuple(row.get(k) for k in GROUP_FIELDS)


def groups(rows: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Rows split by loader setup, in order of first appearance."""
    out: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(group_key(r), []).append(r)
    return list(out.values())


def group_title(rows: Sequence[dict[str, Any]], only: Sequence[str] | None = None) -> str:
    """The loader setup of a group in words; ``only`` restricts it to those fields."""
    r = rows[0]
    parts = []

    def want(k: str) -> bool:
        return only is None or k in only

    if want("workers"):
        parts.append(f"workers={r.get('workers')}")
    if want("batch_size"):
        parts.append(f"batch={r.get('batch_size')}")
    if want("start_method"):
        parts.append(f"start={r.get('start_method')}")
    if want("sampler"):
        parts.append(f"sampler={r.get('sampler')}")
    if want("persistent_workers") and r.get("persistent_workers"):
        parts.append("persistent")
    if want("get_slot") and r.get("get_slot") not in (None, "copy"):
        parts.append(f"get_slot={r.get('get_slot')}")
    if want("world_size") and (r.get("world_size") or 1) > 1:
        parts.append(f"ranks={r.get('world_size')}")
    if want("sizes") and (r.get("sizes") or "fixed") != "fixed":
        parts.append(f"sizes {r['sizes']}")
    if want("loader") and (r.get("loader") or "dataloader") != "dataloader":
        parts.append(f"the caches read by the {r['loader']} loader")
    if want("device") and (r.get("device") or "cpu") != "cpu":
        parts.append(f"trained on {r['device']}")
    lat = r.get("read_latency_ms") or 0.0
    if want("read_latency_ms") and (lat or only is not None):
        parts.append(f"EMULATED read latency {lat:g} ms/miss" if lat else "no added latency")
    return ", ".join(parts)


def varying_fields(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The GROUP_FIELDS that differ between the groups of ``rows``."""
    return [k for k in GROUP_FIELDS if len({r.get(k) for r in rows}) > 1]


def group_slug(rows: Sequence[dict[str, Any]]) -> str:
    r = rows[0]
    s = f"w{r.get('workers')}-b{r.get('batch_size')}-{r.get('start_method')}-{r.get('sampler')}"
    if r.get("persistent_workers"):
        s += "-persistent"
    if r.get("get_slot") not in (None, "copy"):
        s += f"-{r.get('get_slot')}"
    if (r.get("world_size") or 1) > 1:
        s += f"-ranks{r.get('world_size')}"
    s += f"-lat{r.get('read_latency_ms') or 0:g}ms"
    if (r.get("loader") or "dataloader") != "dataloader":
        s += f"-{r['loader']}"
    return s


_MEDIAN = ("epoch_time_s", "samples_per_s", "data_wait_s", "stall_fraction", "hit_rate", "loss",
           "cpu_s")


def aggregate(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (configuration, epoch): the median over repeats (``--repeats``) of the
    timings, hit rate and loss, with ``repeats`` set to how many there were. Rows without a
    ``repeat`` column count as one repeat each."""
    out: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault((r["config"], r["epoch"]), []).append(r)
    agg = []
    for same in out.values():
        row = dict(same[0])
        row["repeats"] = len(same)
        if len(same) > 1:
            row["repeat"] = None
            for k in _MEDIAN:
                vals = [r[k] for r in same if r.get(k) is not None]
                row[k] = statistics.median(vals) if vals else None
        agg.append(row)
    return agg


def configs(rows: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Rows of one group, aggregated over repeats (:func:`aggregate`), split by configuration
    (in order of first appearance), each sorted by epoch."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in aggregate(rows):
        out.setdefault(r["config"], []).append(r)
    return [sorted(v, key=lambda r: r["epoch"]) for v in out.values()]


# ----------------------------------------------------------------------------------------------
# Text
# ----------------------------------------------------------------------------------------------


def _fmt(v: Any, spec: str, none: str = "-") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return none
    return format(v, spec)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """A plain-text table of one group's rows (medians over repeats when there are several)."""
    rows = [r for c in configs(rows) for r in c]
    repeats = max(r["repeats"] for r in rows) if rows else 1
    head = ["config", "cached", "slots", "epoch", "time s", "samples/s", "hit rate",
            "stall", "cpu s", "loss"]
    multi = any(isinstance(r.get("rank_hit_rates"), list) and len(r["rank_hit_rates"]) > 1
                for r in rows)
    if multi:
        head.append("hit rate per rank")
    body = []
    for r in rows:
        line = [
            str(r["config"]),
            _fmt(r.get("cached_pct"), ".0f") + "%",
            _fmt(r.get("slots"), "d"),
            str(r["epoch"]),
            _fmt(r.get("epoch_time_s"), ".2f"),
            _fmt(r.get("samples_per_s"), ",.0f"),
            _fmt(r.get("hit_rate"), ".3f"),
            _fmt(None if r.get("stall_fraction") is None else 100 * r["stall_fraction"], ".0f")
            + "%",
            _fmt(r.get("cpu_s"), ".2f"),
            _fmt(r.get("loss"), ".3f"),
        ]
        if multi:
            rates = r.get("rank_hit_rates") or []
            line.append(" ".join(_fmt(x, ".3f") for x in rates) if r.get("kind") == "cache"
                        else "-")
        body.append(line)
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h)
              for i, h in enumerate(head)]
    right = {1, 2, 3, 4, 5, 6, 7, 8, 9}

    def fmt_line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    sep = "  ".join("-" * w for w in widths)
    lines = [fmt_line(head), sep] + [fmt_line(b) for b in body]
    if repeats > 1:
        lines.append(f"(time, samples/s, hit rate, stall, cpu and loss: medians of {repeats} "
                     "repeats; every repeat is in the CSV)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Target checks
# ----------------------------------------------------------------------------------------------


def _by_epoch(cfg_rows: Sequence[dict[str, Any]], key: str) -> dict[int, float]:
    return {r["epoch"]: r[key] for r in cfg_rows if r.get(key) is not None}


def check_targets(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The three targets of the benchmark, measured on one group's rows (never asserted).

    1. linearity: from epoch 2 on, epoch time at fraction f is within 10% of the straight line
       between the 0% and the 100% run of the same epoch (f = slots / dataset length).
    2. throughput: the 100% run's samples/s (median of epochs >= 2) is >= 90% of the in-RAM
       bound's (same epochs).
    3. fill overhead: the 100% run's first epoch (which fills the cache) takes < 5% longer than
       the no-cache run's first epoch.
    4-5. with a tiered arm (``--tiered-fraction``): its samples/s (median of epochs >= 2) is
       >= 2 x the cache of the same fraction without a tier, and >= 0.8 x the 100% run's.

    Returns:
        One dict per check: ``name``, ``status`` (PASS, MISS or n/a), ``measured`` (a number or
        None), ``target`` and ``detail`` (text with the numbers).
    """
    every = configs(rows)
    tiered = [c for c in every if c[0]["config"].endswith(TIER_SUFFIX)]
    cfgs = [c for c in every if c not in tiered]  # (checks 1-3 are of the memory tier alone)
    none = next((c for c in cfgs if c[0]["kind"] == "none"), None)
    full = next((c for c in cfgs if c[0]["kind"] == "cache" and c[0].get("cached_pct") is not None
                 and c[0]["cached_pct"] >= 100.0), None)
    ram = next((c for c in cfgs if c[0]["kind"] == "ram"), None)
    partial = [c for c in cfgs if c[0]["kind"] == "cache" and c[0].get("cached_pct") is not None
               and 0.0 < c[0]["cached_pct"] < 100.0]
    out: list[dict[str, Any]] = []

    # 1. linearity
    if none is None or full is None or not partial:
        out.append({"name": "linearity", "status": "n/a", "measured": None,
                    "target": f"|dev| <= {LINEARITY_TOL:.0%}",
                    "detail": "needs the no-cache run, a 100% cached run and a partial one"})
    else:
        t0, t1 = _by_epoch(none, "epoch_time_s"), _by_epoch(full, "epoch_time_s")
        c0, c1 = _by_epoch(none, "cpu_s"), _by_epoch(full, "cpu_s")
        for c in partial:
            f = c[0]["cached_pct"] / 100.0
            cf = _by_epoch(c, "cpu_s")
            for e, t in sorted(_by_epoch(c, "epoch_time_s").items()):
                if e < 2 or e not in t0 or e not in t1:
                    continue
                pred = t0[e] + (t1[e] - t0[e]) * f
                dev = t / pred - 1.0
                cpu, cpu_dev = "", None
                if e in c0 and e in c1 and e in cf:
                    cpu_pred = c0[e] + (c1[e] - c0[e]) * f
                    cpu_dev = cf[e] / cpu_pred - 1.0
                    cpu = f" (CPU seconds: {cf[e]:.2f} vs line {cpu_pred:.2f}, {cpu_dev:+.1%})"
                out.append({
                    "name": "linearity", "config": c[0]["config"], "epoch": e,
                    "status": "PASS" if abs(dev) <= LINEARITY_TOL else "MISS",
                    "measured": dev, "cpu_deviation": cpu_dev,
                    "target": f"|dev| <= {LINEARITY_TOL:.0%}",
                    "detail": (f"{c[0]['config']} ({100 * f:.1f}% cached), epoch {e}: "
                               f"{t:.2f} s vs line {pred:.2f} s (0%: {t0[e]:.2f} s, "
                               f"100%: {t1[e]:.2f} s): {dev:+.1%}{cpu}")})
        if not any(o["name"] == "linearity" for o in out):
            out.append({"name": "linearity", "status": "n/a", "measured": None,
                        "target": f"|dev| <= {LINEARITY_TOL:.0%}",
                        "detail": "needs at least 2 epochs"})

    # 2. throughput at 100% against the in-RAM bound
    if full is None or ram is None:
        out.append({"name": "throughput", "status": "n/a", "measured": None,
                    "target": f">= {THROUGHPUT_MIN:.0%} of in-RAM",
                    "detail": "needs a 100% cached run and the in-RAM run"})
    else:
        def later(c: Sequence[dict[str, Any]], key: str) -> tuple[float | None, str]:
            vals = [r[key] for r in c if r["epoch"] >= 2 and r.get(key) is not None]
            if vals:
                return statistics.median(vals), "median of epochs >= 2"
            return c[0].get(key), "epoch 1 only"
        (a, how), (b, _) = later(full, "samples_per_s"), later(ram, "samples_per_s")
        (ca, _), (cb, _) = later(full, "cpu_s"), later(ram, "cpu_s")
        ratio = a / b
        cpu = (f" (CPU seconds per epoch: {ca:.2f} vs {cb:.2f}, {ca / cb - 1.0:+.1%})"
               if ca and cb else "")
        out.append({"name": "throughput", "status": "PASS" if ratio >= THROUGHPUT_MIN else "MISS",
                    "measured": ratio, "target": f">= {THROUGHPUT_MIN:.0%} of in-RAM",
                    "cpu_overhead": ca / cb - 1.0 if ca and cb else None,
                    "detail": (f"100% cached {a:,.0f} samples/s vs in-RAM {b:,.0f} samples/s "
                               f"({how}): {ratio:.1%}{cpu}")})

    # 3. first-epoch fill overhead
    if none is None or full is None:
        out.append({"name": "fill overhead", "status": "n/a", "measured": None,
                    "target": f"< {FILL_OVERHEAD_MAX:.0%}",
                    "detail": "needs the no-cache run and a 100% cached run"})
    else:
        a, b = full[0]["epoch_time_s"], none[0]["epoch_time_s"]
        ov = a / b - 1.0
        ca, cb = full[0].get("cpu_s"), none[0].get("cpu_s")
        cpu = (f" (CPU seconds: {ca:.2f} vs {cb:.2f}, {ca / cb - 1.0:+.1%})"
               if ca and cb else "")
        out.append({"name": "fill overhead", "status": "PASS" if ov < FILL_OVERHEAD_MAX else "MISS",
                    "measured": ov, "target": f"< {FILL_OVERHEAD_MAX:.0%}",
                    "cpu_overhead": ca / cb - 1.0 if ca and cb else None,
                    "detail": (f"epoch 1: 100% cached (filling) {a:.2f} s vs no cache "
                               f"{b:.2f} s: {ov:+.1%}{cpu}")})
    out += _tier_checks(tiered, cfgs, full)
    return out


def _tier_checks(tiered: Sequence[list[dict[str, Any]]], cfgs: Sequence[list[dict[str, Any]]],
                 full: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Issue 38's targets for each tiered arm (epochs >= 2, median samples/s): >= 2 x the cache
    of the same fraction without a tier (the rest decoded), and >= 0.8 x 100 % in /dev/shm.
    None without a tiered arm."""
    def later(c: Sequence[dict[str, Any]]) -> float | None:
        vals = [r["samples_per_s"] for r in c if r["epoch"] >= 2 and r.get("samples_per_s")]
        return statistics.median(vals) if vals else None

    out: list[dict[str, Any]] = []
    for t in tiered:
        label = t[0]["config"]
        same = next((c for c in cfgs if c[0]["config"] == label[:-len(TIER_SUFFIX)]), None)
        a = later(t)
        for name, other, low, what in (
                ("tier vs decoded", same, TIER_VS_DECODED_MIN,
                 f"{label[:-len(TIER_SUFFIX)]} (the rest decoded)"),
                ("tier vs in-shm", full, TIER_VS_SHM_MIN, "cache 100%")):
            b = later(other) if other is not None else None
            if a is None or b is None:
                out.append({"name": name, "config": label, "status": "n/a", "measured": None,
                            "target": f">= {low:g} x",
                            "detail": f"needs {what} and at least 2 epochs"})
                continue
            out.append({"name": name, "config": label,
                        "status": "PASS" if a / b >= low else "MISS", "measured": a / b,
                        "target": f">= {low:g} x",
                        "detail": (f"{label} {a:,.0f} samples/s vs {what} {b:,.0f} samples/s "
                                   f"(median of epochs >= 2): {a / b:.2f} x")})
    return out


def format_checks(checks: Sequence[dict[str, Any]]) -> str:
    """The checks as text; PASS/MISS judge wall time, the CPU seconds in brackets (this process
    and its workers) are for reading results from a machine that other programs share."""
    names = {"linearity": "1. linear in % cached (epochs >= 2)",
             "throughput": "2. 100% cached vs in-RAM samples/s",
             "fill overhead": "3. first-epoch cache-fill overhead",
             "tier vs decoded": "4. disk tier vs decoding the rest (epochs >= 2)",
             "tier vs in-shm": "5. disk tier vs 100% in /dev/shm (epochs >= 2)"}
    lines = []
    for c in checks:
        lines.append(f"  [{c['status']:>4}] {names.get(c['name'], c['name'])}, "
                     f"target {c['target']}: {c['detail']}")
    return "\n".join(lines)
