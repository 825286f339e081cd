"""Capacity (a tmpfs too small, or exactly big enough) and hostile neighbours (other users'
files, links and directories under a segment's name; other jobs; stale and live segments).

Every test runs on its own freshly mounted 64 MiB tmpfs (the size of docker's default
/dev/shm). "Another user" is uid 65534 (nobody): its files are made by a real process running
as that user (``sh`` started with ``user=65534``), not by chown.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import pickle
import re
import signal
import stat
import subprocess
import time
import warnings

import psutil
import pytest
import torch

from _helpers import age, assert_no_leak, budget_for, named, rank_env, run_child, used_bytes
from stocaching import (CacheCapacityError, CacheConfigError, OpenSizeCache, SharedCache,
                        World, clean_segments, list_segments)
from stocaching.stocaching import _MemoryRoom, _segment_name

NOBODY = 65534
W0 = World(rank=0, world_size=2, local_rank=0, local_world_size=2)
W1 = World(rank=1, world_size=2, local_rank=1, local_world_size=2)
SLOT = (256, 1024)  # 256 KiB uint8 samples
SLOT_BYTES = 256 * 1024
N = 1000


def _free(d: str) -> int:
    st = os.statvfs(d)
    return st.f_bavail * st.f_frsize


def _segment_bytes(n: int, slots: int, slot_bytes: int) -> int:
    """Segment size as the SharedCache docstring states it: a 4 KiB header, a 64 KiB stats
    table, one aux byte per sample and 4 bytes per slot (each rounded to 8), padded to a page,
    then the slots."""
    meta = 4096 + 65536 + -(-n // 8) * 8 + -(-4 * slots // 8) * 8
    return -(-meta // mmap.PAGESIZE) * mmap.PAGESIZE + max(1, slots * slot_bytes)


def _as_nobody(cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-c", cmd], user=NOBODY, group=NOBODY, extra_groups=[],
                          capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})


# ----------------------------------------------------------------------------------------------
# (a) capacity
# ----------------------------------------------------------------------------------------------

def _largest_fit(free: int) -> int:
    slots = free // SLOT_BYTES
    while _segment_bytes(N, slots, SLOT_BYTES) > free:
        slots -= 1
    return slots


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["one slot too many", "a GiB in docker's 64 MiB"])
def test_cache_that_does_not_fit_fails_at_construction_and_leaves_nothing(case, tmpfs):
    free = _free(tmpfs)
    if case == "one slot too many":
        n, dims, slots = N, SLOT, _largest_fit(free) + 1
    else:  # 87,373 samples of 12 KiB: a 1 GiB cache
        n, dims, slots = 100_000, (3, 64, 64), 87_373
    slot_bytes = math.prod(dims)
    need = _segment_bytes(n, slots, slot_bytes)
    assert need > free
    with pytest.raises(CacheCapacityError) as info:
        SharedCache(budget_for(slots, dims, dataset_len=n), n, dims, name="big", shm_dir=tmpfs)
    e = info.value
    assert (e.path, e.needed, e.free) == (tmpfs, need, free)
    msg = str(e)
    needs = f"{need / 2**30:.1f} GiB" if need >= 2**30 else f"{need / 2**20:.1f} MiB"
    assert re.search(rf"{re.escape(tmpfs)} has {free / 2**20:.1f} MiB free but the cache needs "
                     rf"{needs} \({slots} slots of {slot_bytes / 1024:.1f} KiB\)\. .*"
                     rf"--shm-size={math.ceil(need / 2**30)}g.*smaller size_limit_gib", msg), msg
    again = pickle.loads(pickle.dumps(e))  # crosses DataLoader worker boundaries intact
    assert (type(again), str(again), again.path, again.needed, again.free) == \
        (CacheCapacityError, msg, e.path, e.needed, e.free)
    assert os.listdir(tmpfs) == [] and used_bytes(tmpfs) == 0


@pytest.mark.timeout(60)
def test_reservation_failing_after_the_free_space_check_leaves_nothing(tmpfs, monkeypatch):
    """Another process takes the space between the free-space check and the reservation.
    That race cannot be timed from outside, so statvfs is faked to report room that the
    tmpfs does not have: the real posix_fallocate then fails with ENOSPC."""
    real = os.statvfs

    def roomy(path):
        st = real(path)
        return os.statvfs_result((st.f_bsize, st.f_frsize, st.f_blocks * 4, st.f_bfree * 4,
                                  st.f_bavail * 4, *st[5:]))

    slots = _largest_fit(_free(tmpfs)) + 8
    monkeypatch.setattr(os, "statvfs", roomy)
    with pytest.raises(CacheCapacityError) as info:
        SharedCache(budget_for(slots, SLOT, dataset_len=N), N, SLOT, name="race", shm_dir=tmpfs)
    monkeypatch.undo()
    assert info.value.needed == _segment_bytes(N, slots, SLOT_BYTES)
    assert os.listdir(tmpfs) == [] and used_bytes(tmpfs) == 0


@pytest.mark.timeout(240)
def test_cache_that_just_fits_fills_completely_without_sigbus(tmpfs):
    """Reserve (posix_fallocate) at construction, so filling every slot of a cache that takes
    nearly all of a tmpfs cannot SIGBUS, even when a neighbour takes the rest. Run in a child
    so a SIGBUS would show as -7."""
    free = _free(tmpfs)
    slots = _largest_fit(free)
    need = _segment_bytes(N, slots, SLOT_BYTES)
    assert free - need < SLOT_BYTES  # as close to the free space as the slot size allows
    assert 0 < slots < N  # a part of the dataset
    r = run_child("fill_to_the_brim.py", tmpfs, repr(budget_for(slots, SLOT, dataset_len=N)), N)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
    built = r.stdout.split("BUILT ")[1].split()
    assert [int(x) for x in built[:2]] == [slots, need]  # the size the docstring promises
    assert int(built[2]) < SLOT_BYTES  # the cache took (nearly) all of the tmpfs
    assert r.stdout.split("FILLED ")[1].split() == [str(slots), "0"]
    os.unlink(os.path.join(tmpfs, "hog"))
    assert_no_leak(tmpfs)

    # The control: the same harness sees the SIGBUS of a file that was not reserved.
    r = run_child("touch_sparse.py", os.path.join(tmpfs, "sparse"), free + (1 << 20))
    assert r.returncode == -signal.SIGBUS, (r.returncode, r.stdout, r.stderr[-500:])
    os.unlink(os.path.join(tmpfs, "sparse"))


# ----------------------------------------------------------------------------------------------
# (b) hostile neighbours
# ----------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_segment_is_private_to_its_creator(tmpfs):
    path = os.path.join(tmpfs, _segment_name("modes", 0, "m"))
    old = os.umask(0)  # the mode must not depend on the umask
    try:
        lead = SharedCache(1, 8, (16,), name="m", job_key="modes", world=W0, shm_dir=tmpfs)
    finally:
        os.umask(old)
    # Published, rank 1 not attached yet: the name is visible to everyone.
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid == os.getuid() and st.st_gid == os.getgid()
    denied = _as_nobody(f"cat '{path}' > /dev/null; echo x >> '{path}'")
    assert denied.stderr.count("Permission denied") == 2, denied.stderr
    # The control: the same user reads a world-readable file next to it (the path is reachable).
    open(os.path.join(tmpfs, "public"), "w").write("ok")
    os.chmod(os.path.join(tmpfs, "public"), 0o644)
    assert _as_nobody(f"cat '{tmpfs}/public'").stdout == "ok"
    os.unlink(os.path.join(tmpfs, "public"))

    follow = SharedCache(1, 8, (16,), name="m", job_key="modes", world=W1, shm_dir=tmpfs)
    assert not os.path.lexists(path)  # everybody attached: the name is gone
    # What each process still holds is the same private file, now without a name.
    fds = [f for f, target in _fd_targets() if target.startswith(tmpfs + "/")]
    assert len(fds) >= 2
    for f in fds:
        assert os.readlink(f"/proc/self/fd/{f}").endswith(" (deleted)")
        st = os.stat(f"/proc/self/fd/{f}")
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
    follow.close()
    lead.close()
    del lead, follow, f  # close() keeps the mapping while the object lives (test_endurance.py)
    assert_no_leak(tmpfs)


def _fd_targets() -> list[tuple[str, str]]:
    out = []
    for f in os.listdir("/proc/self/fd"):
        try:
            out.append((f, os.readlink(f"/proc/self/fd/{f}")))
        except FileNotFoundError:  # the descriptor listdir itself used
            pass
    return out


def _snapshot(path: str) -> tuple:
    st = os.lstat(path)
    body = os.readlink(path) if stat.S_ISLNK(st.st_mode) else (
        open(path, "rb").read() if stat.S_ISREG(st.st_mode) else None)
    return st.st_ino, st.st_uid, st.st_mode, st.st_size, st.st_mtime_ns, body


def _planted_params():
    for kind in ("file", "symlink", "directory"):
        for role in ("leader", "nonleader"):
            yield pytest.param(kind, role, id=f"{kind}-{role}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind,role", list(_planted_params()))
def test_planted_name_of_another_user_is_neither_followed_nor_trusted(kind, role, tmpfs):
    path = os.path.join(tmpfs, _segment_name("victimjob", 0, "train"))
    victim = os.path.join(tmpfs, "victim")  # a file of ours that a link could aim at
    with open(victim, "w") as f:
        f.write("precious")
    os.chmod(victim, 0o644)
    plant = {"file": f"printf 'hostile' > '{path}' && chmod 600 '{path}'",
             "symlink": f"ln -s '{victim}' '{path}'",
             "directory": f"mkdir '{path}'"}[kind]
    r = _as_nobody(plant)
    assert r.returncode == 0, r.stderr
    assert os.lstat(path).st_uid == NOBODY
    before, victim_before = _snapshot(path), _snapshot(victim)

    t0 = time.monotonic()
    with pytest.raises(PermissionError) as info:
        SharedCache(1, 8, (16,), name="train", job_key="victimjob", shm_dir=tmpfs, timeout=60,
                    world=W0 if role == "leader" else W1)
    assert time.monotonic() - t0 < 30  # refused at once, not after waiting for the leader
    assert path in str(info.value)
    assert _snapshot(path) == before and _snapshot(victim) == victim_before
    assert named(tmpfs) == [os.path.basename(path)]  # the leader's temporary file is gone
    # Not ours, so never "stale" either, however old.
    age([path])
    aged = _snapshot(path)
    assert clean_segments(tmpfs) == [] and _snapshot(path) == aged
    assert all(s["state"] != "stale" for s in list_segments(tmpfs) if s["path"] == path)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("role", ["leader", "nonleader"])
def test_own_file_that_is_not_private_is_not_trusted(role, tmpfs):
    path = os.path.join(tmpfs, _segment_name("loose", 0, "train"))
    with open(path, "wb") as f:
        f.write(b"\0" * 8192)
    os.chmod(path, 0o644)
    with pytest.raises(PermissionError, match="mode -rw-r--r--"):
        SharedCache(1, 8, (16,), name="train", job_key="loose", shm_dir=tmpfs, timeout=5,
                    world=W0 if role == "leader" else W1)
    assert open(path, "rb").read() == b"\0" * 8192
    assert named(tmpfs) == [os.path.basename(path)]


@pytest.mark.timeout(60)
def test_two_jobs_of_one_user_coexist_and_a_live_name_is_not_taken(tmpfs):
    a0 = SharedCache(1, 8, (16,), name="train", job_key="jobA", world=W0, shm_dir=tmpfs)
    b0 = SharedCache(1, 8, (16,), name="train", job_key="jobB", world=W0, shm_dir=tmpfs)
    # A third leader with job A's key and name must not replace job A's live segment.
    with pytest.raises(CacheConfigError, match="a live cache is already named"):
        SharedCache(1, 8, (16,), name="train", job_key="jobA", world=W0, shm_dir=tmpfs)
    a0.set_slot(3, torch.full((16,), 1, dtype=torch.uint8))
    b0.set_slot(3, torch.full((16,), 2, dtype=torch.uint8))
    a1 = SharedCache(1, 8, (16,), name="train", job_key="jobA", world=W1, shm_dir=tmpfs)
    b1 = SharedCache(1, 8, (16,), name="train", job_key="jobB", world=W1, shm_dir=tmpfs)
    assert a1.get_slot(3).tolist() == [1] * 16 and b1.get_slot(3).tolist() == [2] * 16
    assert a1.stats()["writes"] == 1 and b1.stats()["writes"] == 1
    for c in (a0, a1, b0, b1):
        c.close()
    del a0, a1, b0, b1, c  # close() keeps the mapping while the object lives (test_endurance.py)
    assert_no_leak(tmpfs)


@pytest.mark.timeout(300)
def test_stale_segments_are_reclaimed_and_live_ones_never_touched(tmpfs, children):
    live = children("live", rank_env(tmpfs, "livejob", rank=0))  # its rank 1 comes later
    dead = children("dead", rank_env(tmpfs, "deadjob", rank=0))
    for c in (live, dead):
        c.send("create")
    for c in (live, dead):
        c.expect("ATTACHED")
    dead.signal(signal.SIGKILL)  # killed during start-up: its published name stays
    assert dead.wait() == -signal.SIGKILL
    live_path = os.path.join(tmpfs, _segment_name("livejob", 0, "f"))
    dead_path = os.path.join(tmpfs, _segment_name("deadjob", 0, "f"))
    plain_path = os.path.join(tmpfs, _segment_name("plainjob", 0, "f"))
    fd = os.open(plain_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)  # nobody holds it
    os.write(fd, b"left over")
    os.close(fd)
    assert named(tmpfs) == sorted(os.path.basename(p) for p in (dead_path, live_path,
                                                                  plain_path))

    # Younger than 2 s a file may be a leader's work in progress: left alone.
    assert clean_segments(tmpfs, dry_run=True) == []
    age([live_path, dead_path, plain_path])
    states = {s["path"]: s for s in list_segments(tmpfs)}
    assert states[dead_path]["state"] == "stale" and states[plain_path]["state"] == "stale"
    assert states[live_path]["state"] == "live" and states[live_path]["pids"] == [live.pid]
    assert sorted(clean_segments(tmpfs, dry_run=True)) == sorted([dead_path, plain_path])
    assert os.path.lexists(dead_path) and os.path.lexists(plain_path)  # a dry run is dry
    assert sorted(clean_segments(tmpfs)) == sorted([dead_path, plain_path])
    assert named(tmpfs) == [os.path.basename(live_path)]

    # The next construction (of any cache of this user there) reclaims them as well.
    again = os.path.join(tmpfs, _segment_name("plainjob2", 0, "f"))
    os.close(os.open(again, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
    age([again])
    with SharedCache(1, 8, (16,), name="other", job_key="otherjob", shm_dir=tmpfs):
        pass
    assert named(tmpfs) == [os.path.basename(live_path)]

    # The live one was not touched: its rank 1 attaches now and reads what rank 0 wrote.
    live.send("write")
    wrote = int(live.expect("WROTE").split()[1])
    rank1 = children("live1", rank_env(tmpfs, "livejob", rank=1))
    rank1.send("create")
    rank1.expect("ATTACHED")
    assert not os.path.lexists(live_path)
    rank1.send("check")
    hits, misses, bad = (int(x) for x in rank1.expect("CHECK").split()[1:4])
    assert (hits, bad) == (wrote, 0)
    for c in (live, rank1):
        c.send("exit")
        assert c.wait() == 0
    assert_no_leak(tmpfs)


# -- size_limit_gib="auto" -------------------------------------------------------------------

def test_auto_size_takes_the_whole_dataset_when_it_fits(tmpfs, caplog):
    caplog.set_level(logging.INFO, logger="stocaching")
    with SharedCache("auto", 1000, (3, 8, 8), shm_dir=tmpfs) as c:
        assert len(c) == 1000
    said = [r.getMessage() for r in caplog.records if "'auto'" in r.getMessage()]
    assert len(said) == 1 and "for 1000 of 1000 samples" in said[0] and "free" in said[0]


def test_auto_size_takes_what_the_tmpfs_holds_and_a_second_rank_takes_the_leaders_count(tmpfs):
    slot = 3 * 64 * 64
    n = 10_000  # 123 MB of samples: more than the 64 MiB tmpfs
    free = os.statvfs(tmpfs).f_bavail * os.statvfs(tmpfs).f_frsize
    worlds = [World(rank=r, world_size=2, local_rank=r, local_world_size=2) for r in range(2)]
    args = dict(dataset_len=n, data_dims=(3, 64, 64), name="auto", job_key=f"auto{os.getpid()}",
                shm_dir=tmpfs, timeout=60)
    with SharedCache("auto", world=worlds[0], **args) as lead:
        assert 0 < len(lead) < n
        left = os.statvfs(tmpfs).f_bavail * os.statvfs(tmpfs).f_frsize
        assert left < slot + 2 * 4096, (free, left)  # the most slots that fit, not fewer
        # The second local rank finds almost nothing free: it takes the leader's count.
        with SharedCache("auto", world=worlds[1], **args) as other:
            assert len(other) == len(lead)
            other.set_slot(5, torch.full((3, 64, 64), 7, dtype=torch.uint8))
            assert int(lead.get_slot(5)[0, 0, 0]) == 7


def test_auto_size_keeps_the_ram_margin(tmpfs, monkeypatch):
    # The machine's RAM cannot be made small for a test: psutil's reading is replaced (a mock)
    # with one that leaves 1 MiB above the margin the RAM warning keeps.
    real = psutil.virtual_memory()
    margin = _MemoryRoom(real.total, real.available, "RAM").margin
    fake = real._replace(available=margin + 2**20)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: fake)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and so no RAM warning either
        with SharedCache("auto", 100_000, (3, 8, 8), shm_dir=tmpfs) as c:
            size = c.stats()["bytes"]
            assert 0 < len(c) < 100_000
            assert 2**20 - (3 * 8 * 8 + 4) - 4096 < size <= 2**20


@pytest.mark.parametrize("kw,match", [
    (dict(data_dims=(None, 3)), r"construct it as OpenSizeCache"),
    (dict(world=World(rank=0, world_size=2, local_rank=0, local_world_size=1, node_rank=0,
                      num_nodes=2)), r"size_limit_gib='auto' is for one node"),
    (dict(size_limit_gib="Auto"), r"positive finite number of GiB or 'auto', but got "
                                  r"size_limit_gib='Auto'"),
])
def test_auto_size_refuses_what_it_cannot_size(tmpfs, kw, match):
    args = dict(size_limit_gib="auto", dataset_len=100, data_dims=(3, 8, 8), shm_dir=tmpfs)
    args.update(kw)
    with pytest.raises((ValueError, TypeError), match=match):
        SharedCache(**args)
    if "data_dims" in kw:  # open sizes: their own class says what 'auto' needs
        with pytest.raises(ValueError, match=r"size_limit_gib='auto' needs samples of a fixed "
                                             r"size"):
            OpenSizeCache(**args)
    assert os.listdir(tmpfs) == []
