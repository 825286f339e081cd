"""Lifecycle: nothing stays in /dev/shm after any kind of exit, start-up leftovers are reclaimed
by the command line, and only the creator removes a name. (The capacity check and
stale-against-live segments are in test_capacity_security.py, the command line itself in
test_cli.py.)"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import pytest

import stocaching
from _helpers import (age, assert_no_leak, free_port, mappers, named, rank_env, run_bounded,
                      run_child, start_child, wait_until_unmapped)
from stocaching import SharedCache


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how,sig", [("exit", None), ("exception", None),
                                     ("wait", signal.SIGINT), ("wait", signal.SIGTERM),
                                     ("wait", signal.SIGKILL)],
                         ids=["exit", "exception", "SIGINT", "SIGTERM", "SIGKILL"])
def test_nothing_left_after_any_exit(shm_dir, how, sig):
    """A process with a filled cache and two DataLoader workers alive (forked, each has sent a
    batch, so each watches its parent) ends in each way; its workers are left to notice."""
    p = start_child("dataloader_then_end.py", how, env=rank_env(shm_dir), stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        assert p.stdout.readline().strip() == "READY"
        p.stdout.close()  # the workers hold the pipe too: do not wait for its end
        assert len(mappers(shm_dir)) == 3  # the cache is up, mapped by the process and its workers
        assert named(shm_dir) == []  # a single-rank cache never keeps a name
        if sig is None:
            p.stdin.close()  # exit or raise now
        else:
            os.kill(p.pid, sig)  # the main process only: its workers are left to notice
        p.wait(timeout=120)
        wait_until_unmapped(shm_dir, within=120)  # workers exit when their parent is gone
        assert mappers(shm_dir) == {} and named(shm_dir) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # never leave a worker behind
        p.stdin.close()


@pytest.mark.timeout(300)
def test_startup_leftover_is_removed_by_clean(shm_dir):
    """A leader of two local ranks SIGKILLed before rank 1 attached leaves its name behind;
    ``python -m stocaching clean`` removes it once it is older than the 2 s grace period."""
    p = start_child("hold_a_cache.py", "--name", "startup", "--dataset-len", 64, "--dims", "[16]",
                    "--size", 1e-3, env=rank_env(shm_dir, "k1", rank=0), stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE)
    assert p.stdout.readline().strip() == "READY"
    left = named(shm_dir)
    assert len(left) == 1 and left[0].endswith("_startup")
    path = os.path.join(shm_dir, left[0])
    st = os.stat(path)
    assert st.st_mode & 0o777 == 0o600 and st.st_uid == os.getuid()
    p.kill()
    p.communicate(timeout=120)
    assert named(shm_dir) == left
    age([path])
    assert stocaching.clean_segments(shm_dir, dry_run=True) == [path]
    assert os.path.exists(path)
    r = subprocess.run([sys.executable, "-m", "stocaching", "--shm-dir", shm_dir, "clean"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and f"removed {path}" in r.stdout
    assert named(shm_dir) == []


@pytest.mark.timeout(120)
def test_a_forked_child_never_removes_the_leaders_name(shm_dir):
    """Only the process that created the segment drops its public name; a fork that closes
    its inherited cache (or exits) must not, or the other local ranks could never attach."""
    world = stocaching.World(rank=0, world_size=2, local_world_size=2)
    c = SharedCache(1e-3, 64, (16,), shm_dir=shm_dir, name="forked", world=world,
                    job_key="fk")
    assert len(named(shm_dir)) == 1
    pid = os.fork()
    if pid == 0:  # the child closes its copy and exits through the normal clean-up
        c.close()
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert len(named(shm_dir)) == 1
    rank1 = stocaching.World(rank=1, world_size=2, local_rank=1, local_world_size=2)
    other = SharedCache(1e-3, 64, (16,), shm_dir=shm_dir, name="forked", world=rank1,
                        job_key="fk", timeout=5)
    assert named(shm_dir) == []  # every local rank attached: the name is gone
    other.close()
    c.close()


@pytest.mark.timeout(60)
def test_a_failed_publish_frees_the_memory(tmpfs):
    """On a tmpfs of its own: /dev/shm's free space moves with every other process using it."""
    world = stocaching.World(rank=0, world_size=2, local_world_size=2)
    a = SharedCache(1e-3, 64, (16,), shm_dir=tmpfs, name="dup", world=world, job_key="fp",
                    timeout=0.2)  # rank 1 never comes: close waits at most this
    used = os.statvfs(tmpfs).f_bfree
    with pytest.raises(stocaching.CacheConfigError, match="a live cache is already named") as e:
        SharedCache(0.01, 1000, (1024,), shm_dir=tmpfs, name="dup", world=world,
                    job_key="fp")
    assert os.statvfs(tmpfs).f_bfree == used  # while the exception is still held
    del e
    a.close()


@pytest.mark.timeout(300)
def test_cleaning_does_not_drop_this_process_slot_locks(shm_dir):
    """POSIX record locks are dropped when a process closes *any* descriptor of the file; a
    cleaner opening our own named segment would release the slot lock another thread holds."""
    world = stocaching.World(rank=0, world_size=2, local_world_size=2)
    c = SharedCache(1e-3, 64, (16,), shm_dir=shm_dir, name="locks", world=world, job_key="lk",
                    timeout=0.2)  # rank 1 never comes: close waits at most this
    (name,) = named(shm_dir)
    path = os.path.join(shm_dir, name)
    age([path])
    c._segment.lock((1 << 50) + 1 + 3)  # as set_slot holds slot 3's lock
    try:
        stocaching.clean_segments(shm_dir)
        r = run_child("lock_probe.py", path, (1 << 50) + 1 + 3)
    finally:
        c._segment.unlock((1 << 50) + 1 + 3)
    assert r.stdout.strip() == "held"
    c.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_leader_that_fails_does_not_hold_back_its_failure_for_the_timeout(tmp_path, tmpfs):
    """Under torchrun, local rank 0 makes the cache (timeout 600 s) and fails with an uncaught
    exception while local rank 1 has not constructed it yet: the leader does not wait for rank
    1 before it exits, so torchrun sees the failure at once (and stops rank 1), the job ends
    with the leader's error well within the wait it used to take, and nothing is left."""
    job = tmp_path / "failing_leader.py"
    job.write_text(
        "import os, time\n"
        "from stocaching import SharedCache\n"
        "if os.environ['LOCAL_RANK'] == '1':\n"
        "    time.sleep(600)  # a rank that is slow to construct its cache\n"
        "c = SharedCache(1e-4, 10, (4,), timeout=600)\n"
        "raise ValueError('the training step failed')\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master-port={free_port()}", str(job)]
    r = run_bounded(cmd, env=rank_env(tmpfs), timeout=200)
    assert r.returncode != 0 and "ValueError: the training step failed" in r.stderr, \
        r.stderr[-3000:]
    assert_no_leak(tmpfs)
