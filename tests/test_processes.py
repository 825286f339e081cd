"""SharedCache across processes: DataLoader workers of every start method, stats seen from the
main process, and local ranks started the way torchrun starts them (and by torchrun itself)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils.data import DataLoader

from _helpers import CachedDataset, value_of
from conftest import leftovers, mappers
from stocaching import SharedCache

N = 64


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
@pytest.mark.parametrize("persistent", [False, True])
def test_dataloader_workers_share_one_cache(shm_dir, method, persistent):
    cache = SharedCache(1, N, (3, 8, 8), shm_dir=shm_dir)
    ds = CachedDataset(cache, N)
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
    assert leftovers(shm_dir) == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RANK_SCRIPT = textwrap.dedent("""
    import json, os, sys, time, torch
    import torch.distributed as dist
    from stocaching import SharedCache, World
    dims = tuple(json.loads(os.environ.get("TEST_DIMS", "[3, 8, 8]")))
    use_dist = os.environ.get("TEST_DIST") == "1"
    if use_dist:
        dist.init_process_group("gloo")
    world = World.from_env()
    cache = SharedCache(1, 32, dims, name="t", timeout=20)
    def barrier(tag):
        if use_dist:
            dist.barrier()
        else:   # without torch.distributed: wait on a file per rank
            open(os.path.join(os.environ["TEST_SYNC"], f"{tag}.{world.local_rank}"), "w").close()
            while len([f for f in os.listdir(os.environ["TEST_SYNC"]) if f.startswith(tag)]) \\
                    < world.local_world_size:
                time.sleep(0.01)
    barrier("attached")
    named = sorted(f for f in os.listdir(os.environ["STOCACHING_SHM_DIR"]))
    # every rank writes its own indices, then every rank reads all of them
    for i in range(world.local_rank, 32, world.local_world_size):
        cache.set_slot(i, torch.full(dims, i, dtype=torch.uint8))
    barrier("written")
    ok = all(torch.equal(cache.get_slot(i), torch.full(dims, i, dtype=torch.uint8))
             for i in range(32))
    barrier("read")
    s = cache.stats()
    result = json.dumps({"rank": world.rank, "ok": ok, "named": named, "stats": s})
    with open(os.path.join(os.environ["TEST_SYNC"], f"result.{world.rank}.json"), "w") as f:
        f.write(result)
    print(result, flush=True)
    if use_dist:
        dist.destroy_process_group()
""")


def _run_ranks(tmp_path, shm_dir, n=2, extra_env=None, timeout=90):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    (tmp_path / "sync").mkdir()
    port = _free_port()
    procs = []
    for r in range(n):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(n), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), STOCACHING_JOB_KEY=f"job{port}",
                   STOCACHING_SHM_DIR=shm_dir, TEST_SYNC=str(tmp_path / "sync"))
        env.update((extra_env or {}).get(r, {}))
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outs = [p.communicate(timeout=timeout) for p in procs]
    return [(p.returncode, o, e) for p, (o, e) in zip(procs, outs)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dist", ["1", "0"], ids=["gloo", "no-init_process_group"])
def test_two_local_ranks_share_one_segment(tmp_path, shm_dir, dist):
    results = _run_ranks(tmp_path, shm_dir, extra_env={0: {"TEST_DIST": dist},
                                                       1: {"TEST_DIST": dist}})
    outs = []
    for rc, out, err in results:
        assert rc == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert all(o["ok"] for o in outs)
    # once both ranks attached, the name is gone: nothing to leak
    assert all(o["named"] == [] for o in outs)
    s = outs[-1]["stats"]
    assert s["writes"] == 32 and s["filled"] == 32 and s["hits"] >= 64
    assert leftovers(shm_dir) == [] and mappers(shm_dir) == []


ATTACH_SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    from stocaching import SharedCache
    dims = tuple(json.loads(sys.argv[1]))
    size = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
    cache = SharedCache(size, 32, dims, name="t", timeout=10)
    print("READY", flush=True)
    sys.stdin.read()   # rank 0 stays up until the test closes its stdin
""")


def _rank_env(shm_dir, rank, key):
    return dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE="2", GROUP_RANK="0", STOCACHING_JOB_KEY=key,
                STOCACHING_SHM_DIR=shm_dir)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args,field", [(["[3, 8, 9]"], "data_dims=(3, 8, 9)"),
                                        (["[3, 8, 8]", "1e-6"], "slot count")])
def test_mismatched_configuration_is_named(tmp_path, shm_dir, args, field):
    script = tmp_path / "attach.py"
    script.write_text(ATTACH_SCRIPT)
    leader = subprocess.Popen([sys.executable, str(script), "[3, 8, 8]"], text=True,
                              env=_rank_env(shm_dir, 0, "mismatch"), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert leader.stdout.readline().strip() == "READY"
        r = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                           env=_rank_env(shm_dir, 1, "mismatch"), timeout=60)
        assert r.returncode != 0
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("stocaching.stocaching.CacheConfigError") and field in last, last
    finally:
        leader.communicate("", timeout=30)
    assert leader.returncode == 0
    assert leftovers(shm_dir) == [] and mappers(shm_dir) == []


@pytest.mark.timeout(60)
def test_waiting_rank_names_the_leader_that_never_came(tmp_path, shm_dir):
    script = tmp_path / "attach.py"
    script.write_text(ATTACH_SCRIPT.replace("timeout=10", "timeout=1"))
    r = subprocess.run([sys.executable, str(script), "[3, 8, 8]"], capture_output=True,
                       text=True, env=_rank_env(shm_dir, 1, "noleader"), timeout=60)
    last = r.stderr.strip().splitlines()[-1]
    assert "CacheTimeoutError" in last and "local rank 0 (the local leader)" in last
    assert leftovers(shm_dir) == []


@pytest.mark.timeout(180)
def test_real_torchrun_two_local_ranks(tmp_path, shm_dir):
    """The same script under the real torchrun, two local ranks, gloo on CPU."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = dict(os.environ, TEST_DIST="1", STOCACHING_SHM_DIR=shm_dir,
               TEST_SYNC=str(tmp_path), OMP_NUM_THREADS="1")
    env.pop("STOCACHING_JOB_KEY", None)  # the job key comes from torchrun's environment
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                        "--master_port", str(_free_port()), str(script)],
                       env=env, capture_output=True, text=True, timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    outs = [json.loads((tmp_path / f"result.{k}.json").read_text()) for k in range(2)]
    assert sorted(o["rank"] for o in outs) == [0, 1] and all(o["ok"] for o in outs)
    assert all(o["named"] == [] for o in outs)
    assert leftovers(shm_dir) == [] and mappers(shm_dir) == []


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
    assert leftovers(shm_dir) == [] and mappers(shm_dir) == []
