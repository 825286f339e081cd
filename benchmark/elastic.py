"""A job interrupted and resumed, on the same world and on a resized one: real torchrun agents.

Run: ``python -m benchmark elastic [--dataset-len 3072] [--fraction 0.3] [--repeats 3]``

Each simulated node is a torchrun agent of its own (static rendezvous on 127.0.0.1, one rank
and its DataLoader workers) with a shared-memory directory of its own (``STOCACHING_SHM_DIR``),
as a machine has its /dev/shm. The ranks train in lockstep (a gloo all-reduce a step, the
gradient sync) over ``CacheAwareSampler``, whose state rank 0 saves at every step, and a
Dataset of the two lines whose source read is an EMULATED latency (``--read-ms`` a miss, a
sleep: no CPU, so the 2 cores do not decide the figures). The arms:

- ``uninterrupted``: 2 nodes, every epoch in one attempt (the reference);
- ``cold restart``: rank 0 is killed (SIGKILL) halfway through epoch 1, torchrun restarts the
  group (``--max-restarts=1``), which resumes the epoch from the saved state with a new, empty
  cache (another cache name an attempt: what a restart got before issue 49);
- ``warm restart``: the same kill and restart, with the cache as the library keeps it;
- ``resize 2 -> 3`` and ``resize 3 -> 2``: a job stops halfway through epoch 1 and a job on
  the other number of nodes resumes it from the saved state; the cache is persistent (a new
  job finds a cache only so), and each node that stays keeps its node rank.

Per epoch (a resumed epoch in its two parts, ``1a`` and ``1b``): the hit rate over every
node, the source reads (misses, which load), the wall time and the samples a second; and
whether every index of the epoch was trained exactly once over the attempts (repeats only the
padding of a world whose ranks do not divide the rest). Targets: after a same-world restart
the resumed part (its samples a second after the loader's start) and the epoch after it run
at >= 0.9 x the uninterrupted run's same epochs; after a resize, every read of the resumed part
of an index that its node held when it attached is a hit, so the hit rate is at least the share
of the new layout the old one held (that share measured at the attach and printed, against the
most the old layout can hand on: the nodes that stay, of the new world's).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .two_lines import TwoLineDataset
from .two_nodes import free_port

DIMS = (3, 32, 32)
TARGET_RESTART = 0.9


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset-len", type=int, default=3072)
    p.add_argument("--fraction", type=float, default=0.3,
                   help="of the dataset each node caches (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=32, help="per rank (default: %(default)s)")
    p.add_argument("--epochs", type=int, default=3, help="(default: %(default)s)")
    p.add_argument("--workers", type=int, default=2,
                   help="DataLoader workers per rank (default: %(default)s)")
    p.add_argument("--read-ms", type=float, default=2.0,
                   help="EMULATED source read latency of a miss, a sleep (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=1, help="runs of every arm (default: 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600, help="seconds a job may take")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)


class _Emulated(TwoLineDataset):
    """The two lines over samples filled with ``i % 256``; a miss sleeps ``read_s`` first (the
    EMULATED source read). An item is its index."""

    n: int  # samples
    read_s: float  # the emulated read of a miss, in seconds

    def __init__(self, cache: Any, n: int, read_s: float) -> None:
        self.cache, self.n, self.read_s = cache, n, read_s

    def __len__(self) -> int:
        return self.n

    def load(self, i: int) -> torch.Tensor:
        time.sleep(self.read_s)
        return torch.full(DIMS, i % 256, dtype=torch.uint8)

    def item(self, i: int, x: torch.Tensor, hit: bool) -> int:
        if int(x[0, 0, 0]) != i % 256:
            raise AssertionError(f"sample {i} read back as another's")
        return i


class _Records:
    """One process's JSON lines (flushed at each line: a killed process keeps what it wrote)."""

    file: Any  # the open file, appended to

    def __init__(self, path: str) -> None:
        self.file = open(path, "a")

    def write(self, **row: Any) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()


def _worker(plan: dict) -> None:
    """One rank of one attempt of a job: attach, resume from the saved state if there is one,
    train the epochs in lockstep, and write what it did."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from stocaching import CacheAwareSampler, SharedCache, World

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # The process group of each attempt meets in a file of its own: the agents' store still
    # holds the failed attempt's addresses, which a restarted gloo group may try to reach.
    dist.init_process_group(
        "gloo", init_method=f"file://{plan['dir']}/group-{plan['job']}-{attempt}",
        rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    world = World.from_env()
    rec = _Records(os.path.join(plan["dir"], f"{plan['job']}-{attempt}-{world.rank}.jsonl"))
    n, batch = plan["dataset_len"], plan["batch_size"]
    slots = int(plan["fraction"] * n)
    gib = (slots * (DIMS[0] * DIMS[1] * DIMS[2]) + n) / 2**30
    name = plan["name"] + (f"a{attempt}" if plan["cold"] else "")
    t0 = time.perf_counter()
    cache = SharedCache(gib, n, DIMS, name=name, layout_seed=plan["seed"],
                        persistent=plan["persistent"], key="elastic" if plan["persistent"] else "")
    held = np.flatnonzero(cache.stored_mask())
    rec.write(kind="attach", job=plan["job"], attempt=attempt, node=world.node_rank,
              rank=world.rank, stored=len(held), slots=len(cache), held=held.tolist(),
              seconds=time.perf_counter() - t0)
    sampler = CacheAwareSampler(cache, batch_size=batch, seed=plan["seed"])
    state_path = plan["state"]
    if os.path.exists(state_path):
        sampler.load_state_dict(torch.load(state_path))
    resumed_epoch = sampler.epoch if os.path.exists(state_path) else None
    loader = DataLoader(_Emulated(cache, n, plan["read_ms"] / 1000), batch_size=batch,
                        sampler=sampler, num_workers=plan["workers"])
    stop = plan.get("stop")
    kill = plan.get("kill") if attempt == 0 else None
    for epoch in range(sampler.epoch, plan["epochs"]):
        sampler.set_epoch(epoch)
        start = sampler.state_dict()["consumed"]
        part = "1b" if epoch == resumed_epoch else "whole"
        dist.barrier()
        before, t0, samples, step = cache.stats(), time.perf_counter(), 0, -1
        first = (0.0, 0)  # (seconds to the first batch, its samples): the loader's start

        def row(part: str) -> None:
            after = cache.stats()
            rec.write(kind="epoch", job=plan["job"], attempt=attempt, epoch=epoch, part=part,
                      node=world.node_rank, rank=world.rank, samples=samples,
                      seconds=time.perf_counter() - t0, first_s=first[0], first_n=first[1],
                      hits=after["hits"] - before["hits"],
                      misses=after["misses"] - before["misses"])
        try:
            for step, got in enumerate(loader):
                dist.all_reduce(torch.zeros(1))  # the step's gradient sync
                samples += len(got)
                if step == 0:
                    first = (time.perf_counter() - t0, len(got))
                rec.write(kind="step", job=plan["job"], attempt=attempt, epoch=epoch,
                          rank=world.rank, indices=got.tolist())
                if world.rank == 0:
                    consumed = min(start + (step + 1) * batch, sampler.num_samples)
                    torch.save(sampler.state_dict(consumed=consumed), state_path + ".tmp")
                    os.replace(state_path + ".tmp", state_path)
                if kill == [epoch, step] and world.rank == 0:
                    row("1a")
                    os.kill(os.getpid(), signal.SIGKILL)
                if stop == [epoch, step]:
                    break
        except RuntimeError:  # a peer was killed: torchrun restarts the group
            row("1a")
            raise
        dist.barrier()  # every rank's reads are in its node's stats
        if stop == [epoch, step]:
            row("1a")
            break
        row(part)
    cache.close()
    dist.destroy_process_group()


def _run_job(plan: dict, nodes: int, shm_dirs: list[str], timeout: float,
             max_restarts: int) -> float:
    """Start ``nodes`` torchrun agents for one job and wait for them; return the seconds."""
    port = free_port()
    plan_path = os.path.join(plan["dir"], f"plan-{plan['job']}.json")
    with open(plan_path, "w") as f:
        json.dump(plan, f)
    procs = []
    t0 = time.perf_counter()
    for k in range(nodes):
        env = dict(os.environ, OMP_NUM_THREADS="1", STOCACHING_SHM_DIR=shm_dirs[k])
        env.pop("STOCACHING_JOB_KEY", None)
        # The static rendezvous: each agent restarts its workers when they fail (the others
        # fail too when one is killed: their collective loses its peer), so every agent
        # counts the same attempts (TORCHELASTIC_RESTART_COUNT). Under the elastic one an
        # agent that restarts for the others' sake counts none, and the attempts disagree.
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}",
               f"--node_rank={k}", "--nproc_per_node=1", "--master_addr=127.0.0.1",
               f"--master_port={port}", f"--max-restarts={max_restarts}",
               "-m", "benchmark.elastic", "--worker", plan_path]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        logs = [p.communicate()[0] for p in procs]
        raise RuntimeError(f"job {plan['job']} ran past {timeout} s:\n" +
                           "\n".join(log[-3000:] for log in logs)) from None
    for p, log in zip(procs, logs):
        if p.returncode != 0:
            raise RuntimeError(f"a torchrun agent of job {plan['job']} failed "
                               f"({p.returncode}):\n{log[-4000:]}")
    return time.perf_counter() - t0


# Each arm: its jobs, as (nodes, what the plan adds) in order.
ARMS: dict[str, list[tuple[int, dict]]] = {
    "uninterrupted": [(2, {})],
    "cold restart": [(2, {"kill": "half", "cold": True})],
    "warm restart": [(2, {"kill": "half"})],
    "resize 2 -> 3": [(2, {"stop": "half", "persistent": True}), (3, {"persistent": True})],
    "resize 3 -> 2": [(3, {"stop": "half", "persistent": True}), (2, {"persistent": True})],
}


def _run_arm(arm: str, args: argparse.Namespace, tmp: str) -> dict:
    """Every job of one arm; returns its rows."""
    from stocaching import clean_segments

    out = os.path.join(tmp, arm.replace(" ", "_").replace(">", ""))
    os.makedirs(out)
    shm_dirs = [tempfile.mkdtemp(prefix=f"stocaching-elastic-n{k}-", dir="/dev/shm")
                for k in range(3)]
    name = f"el{os.getpid()}"
    try:
        for j, (nodes, extra) in enumerate(ARMS[arm]):
            steps = -(-args.dataset_len // (args.batch_size * nodes))
            half = [1, steps // 2]
            plan = {"dir": out, "job": j, "name": name, "state": os.path.join(out, "state.pt"),
                    "dataset_len": args.dataset_len, "batch_size": args.batch_size,
                    "fraction": args.fraction, "epochs": args.epochs, "workers": args.workers,
                    "read_ms": args.read_ms, "seed": args.seed, "cold": False,
                    "persistent": False, **extra}
            for key in ("kill", "stop"):
                if plan.get(key) == "half":
                    plan[key] = half
            _run_job(plan, nodes, shm_dirs, args.timeout, 1 if "kill" in extra else 0)
        left = {}
        for d in shm_dirs:
            clean_segments(d, persistent=[name])
            left[d] = os.listdir(d)
        rows = [json.loads(line) for path in sorted(glob.glob(os.path.join(out, "*.jsonl")))
                for line in open(path)]
        return {"rows": rows, "left": sum(len(v) for v in left.values()),
                "nodes": [nodes for nodes, _ in ARMS[arm]]}
    finally:
        for d in shm_dirs:
            shutil.rmtree(d, ignore_errors=True)


def _epochs(rows: list[dict]) -> list[dict]:
    """Per epoch (and part): hit rate over the nodes, source reads, seconds, samples/s."""
    parts: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["kind"] == "epoch":
            parts.setdefault((r["epoch"], r["part"], r["job"], r["attempt"]), []).append(r)
    out = []
    for (epoch, part, job, attempt), rs in sorted(parts.items()):
        hits, misses = sum(r["hits"] for r in rs), sum(r["misses"] for r in rs)
        seconds = max(r["seconds"] for r in rs)
        samples = sum(r["samples"] for r in rs)
        running = max(r["seconds"] - r["first_s"] for r in rs)  # after each loader's start
        out.append({"epoch": epoch, "part": part, "job": job, "attempt": attempt,
                    "nodes": len({r["node"] for r in rs}), "hit_rate": hits / max(hits + misses, 1),
                    "hits": hits, "reads": misses, "seconds": seconds,
                    "rate": samples / seconds,
                    "running_rate": (samples - sum(r["first_n"] for r in rs)) / running})
    return out


def _exactly_once(rows: list[dict], n: int, epochs: int) -> bool:
    """Every index of each epoch trained once over the attempts and jobs, but for the padding
    of each world that dealt the epoch (fewer repeats than its ranks)."""
    ok = True
    for epoch in range(epochs):
        counts = torch.zeros(n, dtype=torch.int64)
        worlds = {(r["job"], r["attempt"]) for r in rows
                  if r["kind"] == "step" and r["epoch"] == epoch}
        ranks = {w: len({r["rank"] for r in rows if r["kind"] == "step" and
                         (r["job"], r["attempt"]) == w}) for w in worlds}
        for r in rows:
            if r["kind"] == "step" and r["epoch"] == epoch:
                counts += torch.bincount(torch.tensor(r["indices"], dtype=torch.int64),
                                         minlength=n)
        extra = int(counts.sum()) - n
        ok &= bool((counts >= 1).all()) and 0 <= extra <= sum(ranks.values()) - len(ranks)
    return ok


def main(args: argparse.Namespace, argv: Sequence[str],
         say: Callable[[str], None] = print) -> int:
    say(f"load average at the start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    say(f"{args.dataset_len} samples of {DIMS} uint8, {args.fraction} of them cached a node, "
        f"batch {args.batch_size} a rank, {args.workers} DataLoader workers a rank, EMULATED "
        f"source read {args.read_ms} ms a miss; each node a torchrun agent with its own shm "
        f"directory, one rank each")
    verdicts = []
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="stocaching-elastic-") as tmp:
            results = {arm: _run_arm(arm, args, tmp) for arm in args.arms}
        say(f"\nrun {repeat + 1} of {args.repeats} (load {os.getloadavg()[0]:.2f})")
        say(f"{'arm':15s} {'epoch':>5s} {'nodes':>5s} {'hit rate':>8s} {'reads':>6s} "
            f"{'seconds':>7s} {'samples/s':>9s}")
        table = {}
        for arm, res in results.items():
            table[arm] = _epochs(res["rows"])
            for e in table[arm]:
                label = str(e["epoch"]) if e["part"] == "whole" else e["part"]
                say(f"{arm:15s} {label:>5s} {e['nodes']:5d} {e['hit_rate']:8.3f} "
                    f"{e['reads']:6d} {e['seconds']:7.2f} {e['rate']:9.0f}")
            once = _exactly_once(res["rows"], args.dataset_len, args.epochs)
            attach = [r for r in res["rows"] if r["kind"] == "attach"]
            held = {}
            for r in attach:
                held.setdefault((r["job"], r["attempt"]), []).append(r)
            for (job, attempt), rs in sorted(held.items()):
                say(f"{'':15s} attach of job {job} attempt {attempt}: the nodes held "
                    f"{sum(r['stored'] for r in rs)} of their {sum(r['slots'] for r in rs)} "
                    f"slots")
            say(f"{'':15s} every index of every epoch once: {once}; left in the shm "
                f"directories after the job: {res['left']} files")
            verdicts.append(once and res["left"] == 0)
        verdicts += _targets(table, results, args, say)
    say(f"\n{'PASS' if all(verdicts) else 'FAIL'}: {sum(verdicts)} of {len(verdicts)} checks")
    return 0 if all(verdicts) else 1


def _targets(table: dict, results: dict, args: argparse.Namespace,
             say: Callable[[str], None]) -> list[bool]:
    """The targets of this run. A warm restart: its resumed part (after the loader's start)
    and the epoch after it, each against the uninterrupted run's same epoch. A resize: every
    read of the resumed part of an index that its node held at the attach is a hit."""
    verdicts = []
    ref = {e["epoch"]: e for e in table.get("uninterrupted", []) if e["part"] == "whole"}
    for arm in ("warm restart", "cold restart"):
        rows = table.get(arm)
        if not rows or not {1, 2} <= set(ref):
            continue
        part = next(e for e in rows if e["part"] == "1b")
        after = next(e for e in rows if e["epoch"] == 2 and e["part"] == "whole")
        resumed = part["running_rate"] / ref[1]["running_rate"]
        following = after["rate"] / ref[2]["rate"]
        figures = (f"the resumed part of epoch 1 at {resumed:.2f} x the uninterrupted epoch 1 "
                   f"(samples/s after the loader's start; hit rate {part['hit_rate']:.3f} vs "
                   f"{ref[1]['hit_rate']:.3f}), epoch 2 at {following:.2f} x")
        if arm == "warm restart":
            ok = resumed >= TARGET_RESTART and following >= TARGET_RESTART
            verdicts.append(ok)
            say(f"{'PASS' if ok else 'FAIL'} {arm}: {figures} (target >= {TARGET_RESTART} both)")
        else:
            say(f"     {arm}: {figures} (the baseline, no target)")
    for arm in ("resize 2 -> 3", "resize 3 -> 2"):
        if arm not in table:
            continue
        rows = results[arm]["rows"]
        old, new = results[arm]["nodes"]
        attach = [r for r in rows if r["kind"] == "attach" and r["job"] == 1]
        held = {r["rank"]: set(r["held"]) for r in attach}
        steps = [r for r in rows if r["kind"] == "step" and r["job"] == 1 and r["epoch"] == 1]
        reads = sum(len(r["indices"]) for r in steps)
        held_reads = sum(i in held[r["rank"]] for r in steps for i in r["indices"])
        part = next(e for e in table[arm] if e["part"] == "1b")
        share = sum(r["stored"] for r in attach) / sum(r["slots"] for r in attach)
        ok = part["hits"] >= held_reads
        verdicts.append(ok)
        say(f"{'PASS' if ok else 'FAIL'} {arm}: at the attach the nodes held {share:.3f} of the "
            f"new layout's slots (the most {old} nodes hand on to {new}: "
            f"{min(old, new) / new:.3f}); of the resumed part's {reads} reads, {held_reads} "
            f"were of indices their node held, and {part['hits']} hit (hit rate "
            f"{part['hit_rate']:.3f})")
    return verdicts


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        with open(sys.argv[2]) as f:
            _worker(json.load(f))
    else:
        ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        add_arguments(ap)
        sys.exit(main(ap.parse_args(), sys.argv[1:]))
