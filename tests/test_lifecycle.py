"""Lifecycle: nothing stays in /dev/shm after any kind of exit, stale start-up leftovers are
reclaimed, the capacity check, and the command line."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import stocaching
from conftest import leftovers, mappers
from stocaching import CacheCapacityError, SharedCache

# A process that builds a cache (with two DataLoader workers alive, forked), fills it, says
# READY and then waits to be ended in the way the test chooses.
CHILD = textwrap.dedent("""
    import os, signal, sys, time, torch
    from stocaching import SharedCache
    how = sys.argv[1]
    cache = SharedCache(1e-3, 64, (16,), name="life")
    for i in range(64):
        cache.set_slot(i, torch.full((16,), i, dtype=torch.uint8))
    class DS(torch.utils.data.Dataset):
        def __len__(self): return 64
        def __getitem__(self, i): return cache.get_slot(i)
    it = iter(torch.utils.data.DataLoader(DS(), batch_size=4, num_workers=2,
                                          persistent_workers=True))
    next(it)
    print("READY", flush=True)
    if how == "exit":
        sys.exit(0)
    if how == "exception":
        raise RuntimeError("boom")
    time.sleep(60)
""")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how,sig", [("exit", None), ("exception", None),
                                     ("wait", signal.SIGINT), ("wait", signal.SIGTERM),
                                     ("wait", signal.SIGKILL)],
                         ids=["exit", "exception", "SIGINT", "SIGTERM", "SIGKILL"])
def test_nothing_left_after_any_exit(tmp_path, shm_dir, how, sig):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    p = subprocess.Popen([sys.executable, str(script), how], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    assert p.stdout.readline().strip() == "READY"
    p.stdout.close()  # the workers hold the pipe too: do not wait for its end
    assert mappers(shm_dir)  # the cache is up and mapped by the process and its workers
    assert leftovers(shm_dir) == []  # a single-rank cache never keeps a name
    if sig is not None:
        os.kill(p.pid, sig)  # the main process only: its workers are left to notice
    p.wait(timeout=60)
    deadline = time.monotonic() + 60
    while mappers(shm_dir) and time.monotonic() < deadline:
        time.sleep(0.1)  # DataLoader workers exit when their parent is gone
    try:
        assert mappers(shm_dir) == [] and leftovers(shm_dir) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # never leave a worker behind


LEADER = textwrap.dedent("""
    import time
    from stocaching import SharedCache
    cache = SharedCache(1e-3, 64, (16,), name="startup", timeout=5)
    print("READY", flush=True)
    time.sleep(60)
""")


def _leader_env(shm_dir, key):
    return dict(os.environ, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2",
                STOCACHING_JOB_KEY=key, STOCACHING_SHM_DIR=shm_dir)


def _killed_during_startup(tmp_path, shm_dir, key):
    """A leader of two local ranks SIGKILLed before rank 1 attached leaves its name behind."""
    script = tmp_path / "leader.py"
    script.write_text(LEADER)
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                         env=_leader_env(shm_dir, key))
    assert p.stdout.readline().strip() == "READY"
    named = leftovers(shm_dir)
    assert len(named) == 1 and named[0].endswith("_startup")
    st = os.stat(os.path.join(shm_dir, named[0]))
    assert st.st_mode & 0o777 == 0o600 and st.st_uid == os.getuid()
    p.kill()
    p.wait(timeout=30)
    assert leftovers(shm_dir) == named
    path = os.path.join(shm_dir, named[0])
    os.utime(path, (time.time() - 10, time.time() - 10))  # older than the 2 s grace period
    return path


@pytest.mark.timeout(60)
def test_startup_leftover_is_removed_by_clean(tmp_path, shm_dir):
    path = _killed_during_startup(tmp_path, shm_dir, "k1")
    assert stocaching.clean_segments(shm_dir, dry_run=True) == [path]
    assert os.path.exists(path)
    r = subprocess.run([sys.executable, "-m", "stocaching", "--shm-dir", shm_dir, "clean"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and f"removed {path}" in r.stdout
    assert leftovers(shm_dir) == []


@pytest.mark.timeout(60)
def test_startup_leftover_is_removed_by_the_next_construction(tmp_path, shm_dir):
    _killed_during_startup(tmp_path, shm_dir, "k2")
    c = SharedCache(1e-3, 64, (16,), shm_dir=shm_dir, name="other")
    assert leftovers(shm_dir) == []
    c.close()


@pytest.mark.timeout(60)
def test_live_segment_is_never_cleaned(tmp_path, shm_dir):
    script = tmp_path / "leader.py"
    script.write_text(LEADER)
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                         env=_leader_env(shm_dir, "live"))
    try:
        assert p.stdout.readline().strip() == "READY"
        (name,) = leftovers(shm_dir)
        os.utime(os.path.join(shm_dir, name), (time.time() - 10, time.time() - 10))
        assert stocaching.clean_segments(shm_dir) == []
        assert leftovers(shm_dir) == [name]
        segs = stocaching.list_segments(shm_dir)
        assert [(s["state"], s["pids"]) for s in segs] == [("live", [p.pid])]
    finally:
        p.kill()
        p.wait(timeout=30)


def test_cli_info_lists_live_segments(shm_dir):
    c = SharedCache(1e-3, 64, (16,), shm_dir=shm_dir, name="shown")
    r = subprocess.run([sys.executable, "-m", "stocaching", "--shm-dir", shm_dir],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "free" in r.stdout and "RAM:" in r.stdout
    line = [ln for ln in r.stdout.splitlines() if "_shown" in ln]
    assert len(line) == 1 and "live" in line[0] and str(os.getpid()) in line[0] \
        and "(unlinked)" in line[0]
    c.close()


def test_cli_plan(shm_dir):
    r = subprocess.run([sys.executable, "-m", "stocaching", "plan", "--dataset-len", "1000",
                        "--dims", "3,32,32", "--size-gib", "0.001"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("349 of 1000 samples") and "34.9% of the dataset" in r.stdout
    assert stocaching.plan(1000, (3, 32, 32), size_limit_gib=0.001)["slots"] == \
        len(SharedCache(0.001, 1000, (3, 32, 32), shm_dir=shm_dir))
    bad = subprocess.run([sys.executable, "-m", "stocaching", "plan", "--dataset-len", "0",
                          "--dims", "3,32"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "dataset_len should be a positive int" in bad.stderr


def test_capacity_error_on_a_small_tmpfs(small_tmpfs):
    with pytest.raises(CacheCapacityError, match=r"has 64.0 MiB free but the cache needs "
                       r"1.0 GiB .*--shm-size=2g.*smaller size_limit_gib") as e:
        SharedCache(1, 100_000, (3, 64, 64), shm_dir=small_tmpfs)
    assert e.value.needed > e.value.free and e.value.path == small_tmpfs
    assert leftovers(small_tmpfs) == []


@pytest.mark.timeout(60)
def test_cache_that_just_fits_fills_without_sigbus(small_tmpfs):
    """Reserve (posix_fallocate) at construction, so filling every slot of a cache that takes
    nearly all of a tmpfs cannot SIGBUS. Run in a child so a SIGBUS would show as -7."""
    code = textwrap.dedent(f"""
        import os, torch
        from stocaching import SharedCache
        st = os.statvfs({small_tmpfs!r})
        free = st.f_bavail * st.f_frsize
        n = 10000   # 117 MiB of samples: more than the tmpfs holds
        gib = (free - 200_000) / 2**30   # header, stats and sequence numbers ride on top
        c = SharedCache(gib, n, (3, 64, 64), shm_dir={small_tmpfs!r})
        x = torch.ones(3, 64, 64, dtype=torch.uint8)
        for i in range(n):
            c.set_slot(i, x)
        st = os.statvfs({small_tmpfs!r})
        print(len(c), c.stats()["filled"], st.f_bavail * st.f_frsize)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, (r.returncode, r.stderr)
    slots, filled, free_after = map(int, r.stdout.split())
    assert 4000 < slots < 10000 and filled == slots
    assert free_after < 256 * 1024  # the cache took (nearly) the whole tmpfs


@pytest.mark.timeout(60)
def test_a_forked_child_never_removes_the_leaders_name(shm_dir):
    """Only the process that created the segment drops its public name; a fork that closes
    its inherited cache (or exits) must not, or the other local ranks could never attach."""
    world = stocaching.World(rank=0, world_size=2, local_world_size=2)
    c = SharedCache(1e-3, 64, (16,), shm_dir=shm_dir, name="forked", world=world,
                    job_key="fk")
    assert len(leftovers(shm_dir)) == 1
    pid = os.fork()
    if pid == 0:  # the child closes its copy and exits through the normal clean-up
        c.close()
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert len(leftovers(shm_dir)) == 1
    rank1 = stocaching.World(rank=1, world_size=2, local_rank=1, local_world_size=2)
    other = SharedCache(1e-3, 64, (16,), shm_dir=shm_dir, name="forked", world=rank1,
                        job_key="fk", timeout=5)
    assert leftovers(shm_dir) == []  # every local rank attached: the name is gone
    other.close()
    c.close()


@pytest.mark.timeout(60)
def test_a_failed_publish_frees_the_memory(shm_dir):
    world = stocaching.World(rank=0, world_size=2, local_world_size=2)
    a = SharedCache(1e-3, 64, (16,), shm_dir=shm_dir, name="dup", world=world, job_key="fp")
    used = os.statvfs(shm_dir).f_bfree
    with pytest.raises(stocaching.CacheConfigError, match="a live cache is already named") as e:
        SharedCache(0.01, 1000, (1024,), shm_dir=shm_dir, name="dup", world=world,
                    job_key="fp")
    assert os.statvfs(shm_dir).f_bfree == used  # while the exception is still held
    del e
    a.close()


@pytest.mark.timeout(60)
def test_cleaning_does_not_drop_this_process_slot_locks(tmp_path, shm_dir):
    """POSIX record locks are dropped when a process closes *any* descriptor of the file; a
    cleaner opening our own named segment would release the slot lock another thread holds."""
    world = stocaching.World(rank=0, world_size=2, local_world_size=2)
    c = SharedCache(1e-3, 64, (16,), shm_dir=shm_dir, name="locks", world=world, job_key="lk")
    (name,) = leftovers(shm_dir)
    path = os.path.join(shm_dir, name)
    os.utime(path, (time.time() - 10, time.time() - 10))
    probe = textwrap.dedent(f"""
        import fcntl, os, sys
        fd = os.open({path!r}, os.O_RDWR)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, (1 << 50) + 1 + 3)
            print("free")
        except OSError:
            print("held")
    """)
    with c._locked((1 << 50) + 1 + 3):  # as set_slot holds slot 3's lock
        stocaching.clean_segments(shm_dir)
        r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                           timeout=30)
    assert r.stdout.strip() == "held"
    c.close()
