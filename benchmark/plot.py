"""Plots from benchmark rows, and the ``analyze`` command (CSV -> plots + checks)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Sequence

from . import report


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def plot_epoch_time(rows: Sequence[dict[str, Any]], path: str | Path,
                    title: str | None = None) -> Path:
    """Epoch time against % cached for one group: one line per epoch, the in-RAM bound as a
    horizontal reference (median of its epochs >= 2, or its only epoch)."""
    plt = _pyplot()
    cfgs = report.configs(rows)
    curve = [c for c in cfgs if c[0]["kind"] in ("none", "cache")]
    ram = next((c for c in cfgs if c[0]["kind"] == "ram"), None)
    epochs = sorted({r["epoch"] for c in curve for r in c})
    fig, ax = plt.subplots(figsize=(9.5, 4.8), dpi=110)
    for e in epochs:
        pts = sorted((r["cached_pct"], r["epoch_time_s"]) for c in curve for r in c
                     if r["epoch"] == e and r.get("cached_pct") is not None)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    label=f"epoch {e}" + (" (fills the cache)" if e == 1 else ""))
    if ram is not None:
        later = [r["epoch_time_s"] for r in ram if r["epoch"] >= 2] or \
            [r["epoch_time_s"] for r in ram]
        t = statistics.median(later)
        ax.axhline(t, color="black", linestyle="--", linewidth=1.2,
                   label=f"in-RAM upper bound ({t:.2f} s)")
    ax.set_xlabel("% of the dataset cached")
    ax.set_ylabel("epoch time (s)")
    ax.set_xlim(-3, 103)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)  # (off the lines)
    ax.set_title(f"{_head(rows[0])}\n{title or report.group_title(rows)}", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def _head(r0: dict[str, Any]) -> str:
    """The dataset in a plot's title."""
    sizes = r0.get("sizes") or "fixed"
    if sizes == "fixed":
        return (f"{r0.get('num_images')} JPEGs {r0.get('image_size')}px -> cached "
                f"{r0.get('decoded_size')}px")
    return (f"{r0.get('num_images')} JPEGs, sides {sizes.split()[-1]}px, cached at native "
            f"size -> {r0.get('decoded_size')}px crop after the cache")


def plot_throughput(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Samples/s of the last epoch against % cached, one line per group (a sweep's summary);
    each group's in-RAM bound is drawn as a marker at 100%."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10.5, 5.2), dpi=110)
    vary = report.varying_fields(rows)
    fixed = [k for k in report.GROUP_FIELDS if k not in vary]
    for g in report.groups(rows):
        cfgs = report.configs(g)
        last = max(r["epoch"] for r in g)
        pts = sorted((r["cached_pct"], r["samples_per_s"]) for c in cfgs for r in c
                     if c[0]["kind"] in ("none", "cache") and r["epoch"] == last
                     and r.get("cached_pct") is not None)
        if not pts:
            continue
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                        label=report.group_title(g, only=vary) or "all")
        ram = next((c for c in cfgs if c[0]["kind"] == "ram"), None)
        if ram is not None:
            ax.plot([100], [ram[-1]["samples_per_s"]], marker="*", markersize=11,
                    color=line.get_color(), linestyle="none")
    ax.set_xlabel("% of the dataset cached")
    ax.set_ylabel("samples/s (last epoch; star = in-RAM bound)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)  # (off the lines)
    ax.set_title(f"{_head(rows[0])}; {report.group_title(rows, only=fixed)}", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def make_plots(rows: Sequence[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """``epoch_time_vs_cached.png`` for a single group; for several, one
    ``epoch_time_vs_cached__<group>.png`` each plus ``throughput_vs_cached.png``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    gs = report.groups(rows)
    if len(gs) == 1:
        return [plot_epoch_time(gs[0], out_dir / "epoch_time_vs_cached.png")]
    paths = [plot_epoch_time(g, out_dir / f"epoch_time_vs_cached__{report.group_slug(g)}.png")
             for g in gs]
    paths.append(plot_throughput(rows, out_dir / "throughput_vs_cached.png"))
    return paths


def analyze(csv_path: str | Path, out_dir: str | Path | None = None) -> tuple[list[Path], str]:
    """Redo the plots, tables and target checks of any run's or sweep's CSV.

    Returns:
        ``(plot paths, text report)``.
    """
    csv_path = Path(csv_path)
    rows = report.read_csv(csv_path)
    if not rows:
        raise ValueError(f"{csv_path} has no rows")
    out_dir = Path(out_dir) if out_dir is not None else csv_path.parent
    paths = make_plots(rows, out_dir)
    text = []
    for g in report.groups(rows):
        text.append(f"== {report.group_title(g)}")
        text.append(report.format_table(g))
        text.append("target checks:")
        text.append(report.format_checks(report.check_targets(g)))
        text.append("")
    return paths, "\n".join(text)
