"""SharedCache across processes: DataLoader workers of every start method, stats seen from the
main process, and local ranks started the way torchrun starts them (and by torchrun itself)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader

from _helpers import (CHILDREN, TwoLineDataset, free_port, mappers, named, rank_env, run_child,
                      start_child, value_of)
from stocaching import SharedCache

N = 64


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
@pytest.mark.parametrize("persistent", [False, True])
def test_dataloader_workers_share_one_cache(shm_dir, method, persistent):
    cache = SharedCache(1, N, (3, 8, 8), shm_dir=shm_dir)
    ds = TwoLineDataset(cache, N)
    dl = DataLoader(ds, batch_size=8, shuffle=True, num_workers=2, multiprocessing_context=method,
                    persistent_workers=persistent, generator=torch.Generator().manual_seed(0))
    epochs = []
    for _ in range(3):
        seen, hits = [], 0
        for idx, x, hit in dl:
            for i, xi in zip(idx.tolist(), x):
                assert torch.equal(xi, value_of(i))
            seen += idx.tolist()
            hits += int(hit.sum())
        assert sorted(seen) == list(range(N))
        epochs.append(hits)
    assert epochs == [0, N, N]  # written by workers in epoch 1, hits in every worker after
    # the main process sees the workers' writes and counts
    assert all(torch.equal(cache.get_slot(i), value_of(i)) for i in range(N))
    s = cache.stats()
    assert (s["hits"], s["misses"], s["writes"], s["filled"]) == (2 * N + N, N, N, N)
    del dl
    cache.close()
    assert named(shm_dir) == []


def _run_ranks(tmp_path, shm_dir, n=2, extra_env=None, timeout=240):
    (tmp_path / "sync").mkdir()
    port = free_port()
    procs = [start_child("rank.py", env=rank_env(shm_dir, f"job{port}", rank=r, world_size=n,
                                                  port=port, TEST_SYNC=tmp_path / "sync",
                                                  **(extra_env or {})),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(n)]
    outs = [p.communicate(timeout=timeout) for p in procs]
    return [(p.returncode, o, e) for p, (o, e) in zip(procs, outs)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dist", ["1", "0"], ids=["gloo", "no-init_process_group"])
def test_two_local_ranks_share_one_segment(tmp_path, shm_dir, dist):
    results = _run_ranks(tmp_path, shm_dir, extra_env={"TEST_DIST": dist})
    outs = []
    for rc, out, err in results:
        assert rc == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert all(o["ok"] for o in outs)
    # once both ranks attached, the name is gone: nothing to leak
    assert all(o["named"] == [] for o in outs)
    s = outs[-1]["stats"]
    assert s["writes"] == 32 and s["filled"] == 32 and s["hits"] >= 64
    assert named(shm_dir) == [] and mappers(shm_dir) == {}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("args,field", [(["--dims", "[3, 8, 9]"], "data_dims=(3, 8, 9)"),
                                        (["--size", "1e-6"], "slot count")])
def test_mismatched_configuration_is_named(shm_dir, args, field):
    leader = start_child("hold_a_cache.py", env=rank_env(shm_dir, "mismatch", rank=0),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert leader.stdout.readline().strip() == "READY"
        r = run_child("hold_a_cache.py", *args, env=rank_env(shm_dir, "mismatch", rank=1))
        assert r.returncode != 0
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("stocaching.stocaching.CacheConfigError") and field in last, last
    finally:
        leader.communicate("", timeout=120)
    assert leader.returncode == 0
    assert named(shm_dir) == [] and mappers(shm_dir) == {}


@pytest.mark.timeout(300)
def test_waiting_rank_names_the_leader_that_never_came(shm_dir):
    r = run_child("hold_a_cache.py", "--timeout", 1, env=rank_env(shm_dir, "noleader", rank=1))
    last = r.stderr.strip().splitlines()[-1]
    assert "CacheTimeoutError" in last and "local rank 0 (the local leader)" in last
    assert named(shm_dir) == []


@pytest.mark.timeout(400)
def test_real_torchrun_two_local_ranks(tmp_path, shm_dir):
    """The same program under the real torchrun, two local ranks, gloo on CPU."""
    # The job key comes from torchrun's environment.
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                        "--master_port", str(free_port()), str(CHILDREN / "rank.py")],
                       env=rank_env(shm_dir, TEST_DIST=1, TEST_SYNC=tmp_path),
                       capture_output=True, text=True, timeout=360)
    assert r.returncode == 0, r.stderr[-3000:]
    outs = [json.loads((tmp_path / f"result.{k}.json").read_text()) for k in range(2)]
    assert sorted(o["rank"] for o in outs) == [0, 1] and all(o["ok"] for o in outs)
    assert all(o["named"] == [] for o in outs)
    assert named(shm_dir) == [] and mappers(shm_dir) == {}


@pytest.mark.timeout(300)
def test_two_nodes_under_real_torchrun(tmp_path, shm_dir):
    """Two torchrun agents on 127.0.0.1 (--nnodes=2), each node with its own segment: the
    cache-aware sampler reads from the node's own cache about n*f of the time, a plain
    DistributedSampler at most f, and every index is visited once per epoch either way."""
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, "-m", "benchmark.two_nodes", "--dataset-len", "2048",
                        "--fraction", "0.25", "--epochs", "2", "--json", str(out),
                        "--timeout", "240"],
                       capture_output=True, text=True, timeout=280,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    for sampler, rows in res.items():
        assert all(row["covers_all"] for row in rows)
        assert {row["slots"] for row in rows} == {512}
        second = [row["node_hit_rate"] for row in rows if row["epoch"] == 1]
        if sampler == "cache-aware":
            assert min(second) >= 0.95 * 0.5  # ideal for n=2, f=0.25: n*f = 0.5
        else:
            assert max(second) <= 0.25 + 0.05
    assert named(shm_dir) == [] and mappers(shm_dir) == {}
