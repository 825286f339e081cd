"""A cache kept across torchrun's restarts (holder.py): real torchrun, a worker SIGKILLed
mid-epoch, the restarted attempt hitting what the first one cached, every index of the epoch
once over both, and nothing left after the job; the holder gone when the agent is."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time

import psutil
import pytest

from _helpers import CHILDREN, assert_ended_well, assert_no_leak, rank_env, run_bounded

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N, KILL_AT = 480, 12  # restart_job.py's indices, and the step at which rank 1 dies


def _holders(shm: str) -> list[psutil.Process]:
    """The holders of caches in the directory ``shm`` (they inherit its variable)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        with contextlib.suppress(psutil.Error):
            if any(part.endswith("holder.py") for part in cmd) and \
                    p.status() != psutil.STATUS_ZOMBIE and \
                    p.environ().get("STOCACHING_SHM_DIR") == shm:
                found.append(p)
    return found


def _wait_no_holder(shm: str, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while _holders(shm):
        assert time.monotonic() < deadline, f"holders left: {_holders(shm)}"
        time.sleep(0.05)


def _restart_job(tmp_path, tmpfs, env):
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--max-restarts=1", str(CHILDREN / "restart_job.py"), str(out), str(KILL_AT)]
    assert_ended_well(run_bounded(cmd, env=env, timeout=400))
    records = {(a, r): json.load(open(out / f"attempt{a}.rank{r}.json"))
               for a in (0, 1) for r in (0, 1)}
    first = [i for r in (0, 1) for i in records[0, r]["epoch0"]]
    rest = [i for r in (0, 1) for i in records[1, r]["epoch0"]]
    assert len(first) == KILL_AT * 16 and sorted(first + rest) == list(range(N))
    kept = set(first)
    reads = [hit for r in (0, 1) for i, hit in records[1, r]["epoch1"] if i in kept]
    rate = sum(reads) / len(reads)
    filled = records[1, 0]["filled_at_start"]
    print(f"\n[restart] the restarted attempt began with {filled} slots filled; its hit rate on "
          f"the {len(kept)} indices the first attempt cached: {rate:.3f} ({len(reads)} reads)")
    return filled, rate, len(kept)


@pytest.mark.parametrize("stdin", ["open", "closed"])
def test_a_first_attempt_with_no_holder_to_ask_leaves_the_leaders_descriptors_alone(stdin,
                                                                                  tmpfs):
    """Under the agent's variables, a leader that finds no holder makes its cache and starts
    one, with its standard input as it was, or closed (a launcher may start its workers so: CI
    does); close() lets the holder go. (A "no holder" answer once passed for descriptor 0.)"""
    code = (f"import os, torch\n{'os.close(0)' if stdin == 'closed' else ''}\n"
            "from stocaching import SharedCache\n"
            "c = SharedCache(1e-4, 10, (4,), name='first')\n"
            "c.set_slot(1, torch.ones(4, dtype=torch.uint8))\n"
            "assert int(c.get_slot(1).sum()) == 4\n"
            f"{'os.fstat(0)' if stdin == 'open' else ''}\n"  # (raises if it was closed)
            "c.close()\nprint('made')\n")
    env = dict(rank_env(tmpfs), TORCHELASTIC_RUN_ID="first-attempt")
    r = run_bounded([sys.executable, "-c", code], env=env, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "made", r.stderr[-3000:]
    _wait_no_holder(tmpfs)
    assert_no_leak(tmpfs)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_restarted_torchrun_group_finds_the_cache_warm_and_nothing_is_left(tmp_path, tmpfs):
    """Rank 1 SIGKILLs itself mid-epoch; torchrun restarts the group, which resumes from the
    sampler's state saved at the last batch boundary: every index once over the two
    attempts, every read of an index the first attempt cached a hit (each value checked by
    the job), no holder and nothing in the shm directory once the job is over."""
    filled, rate, kept = _restart_job(tmp_path, tmpfs, rank_env(tmpfs))
    assert filled >= kept and rate == 1.0
    _wait_no_holder(tmpfs)
    assert_no_leak(tmpfs)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_copied_core_alone_restarts_cold_under_torchrun(tmp_path, tmpfs):
    """stocaching.py copied without holder.py (samplers.py beside it for the sampler, with the
    files it needs): the same job still gives every index once; its restarted attempt starts
    with an empty cache, and nothing is left."""
    alone = tmp_path / "alone"
    alone.mkdir()
    for module in ("stocaching", "samplers", "_common", "masks", "trainers"):
        (alone / f"{module}.py").write_text(open(os.path.join(REPO, "stocaching",
                                                              f"{module}.py")).read())
    env = rank_env(tmpfs)
    env["PYTHONPATH"] = str(alone)
    filled, rate, _ = _restart_job(tmp_path, tmpfs, env)
    assert filled == 0 and rate == 0.0
    assert _holders(tmpfs) == []
    assert_no_leak(tmpfs)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_holder_exits_when_the_agent_is_killed(tmp_path, tmpfs):
    """SIGKILL torchrun's agent while its workers hold a cache: the holder exits (it never
    outlives the agent), and once the orphaned workers are gone nothing is left."""
    ready = tmp_path / "ready"
    code = ("import os, time, torch.distributed as dist; from stocaching import SharedCache; "
            "c = SharedCache(1e-3, 64, (4,), name='held'); open(os.environ['READY'] + "
            "os.environ['LOCAL_RANK'], 'w').close(); time.sleep(600)")
    script = tmp_path / "hold.py"
    script.write_text(code)
    env = rank_env(tmpfs, READY=str(ready))
    agent = psutil.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node=2", str(script)], env=env,
                         stdout=open(tmp_path / "log", "w"), stderr=open(tmp_path / "err", "w"),
                         start_new_session=True)
    try:
        deadline = time.monotonic() + 200
        while not all(os.path.exists(f"{ready}{r}") for r in (0, 1)):
            assert agent.poll() is None, open(tmp_path / "err").read()[-3000:]
            assert time.monotonic() < deadline, "the workers never made their cache"
            time.sleep(0.1)
        holders = _holders(tmpfs)
        assert len(holders) == 1
        workers = agent.children()
        agent.send_signal(signal.SIGKILL)
        agent.wait(60)
        _wait_no_holder(tmpfs)  # (exited: a zombie until the worker that started it reaps it)
    finally:
        for p in [agent] + agent.children(recursive=True) if agent.is_running() else []:
            p.kill()
    for w in workers:
        if w.is_running():
            w.kill()
    psutil.wait_procs(workers, timeout=60)
    assert_no_leak(tmpfs)
