"""Fault injection: SIGKILL, SIGTERM and SIGINT at each phase of a cache's life, in each role.

Roles: the local leader and a non-leader local rank of a two-rank job (separate
``Popen([sys.executable, script])`` processes with torchrun's variables, as torchrun starts
them), a DataLoader worker, and the main process of a single-process job. Phases:

* ``startup``: the leader is inside ``SharedCache.__init__`` with its file created and reserved
  but not yet published (a non-leader is waiting for it; a worker is in ``worker_init_fn``);
* ``attach``: the leader has published the segment and nobody attached yet, a non-leader holds
  the segment's lock and mapping but has not yet counted itself in, a spawned worker has mapped
  the segment while unpickling the dataset;
* ``write``: inside ``set_slot``, half of the bytes copied;
* ``read``: inside a loop of ``get_slot``.

To stop a process at an exact phase the child (tests/children/job.py) wraps one function or one
buffer of the library (``os.posix_fallocate``, ``SharedCache._check_header``,
``cache._slot_samples``) so that it prints a marker and waits: a signal cannot otherwise be timed
to land inside one call. The wrappers call the real code; the signals, processes, locks and tmpfs
are real. Every wait of the test is for a marker or an exit, with a ceiling far above what it
takes.

Each cell checks: the target dies of the signal; nothing stays mapped or held by any process;
the survivors either carry on (every value read back is right, the slot whose writer died reads
as a miss and can be written again) or fail with a clear error (a waiting rank raises
``CacheTimeoutError`` naming local rank 0, the DataLoader names the dead worker); nothing with
the stocaching prefix is left in the tmpfs, or, where the design leaves a file behind (a leader
killed before every rank attached), ``clean_segments`` and the next construction remove it; the
tmpfs gets all its memory back; and the same job runs again right away.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time

import numpy as np
import pytest
import torch

from _helpers import (age, assert_no_leak, free_port, named, rank_env, ranks_with_a_killed_writer,
                      rerun, wait_until_unmapped)
from stocaching import SharedCache, clean_segments, list_segments

N, D = 32, 1024  # the children's FT_N, FT_D defaults
TIMEOUT = 2  # seconds a non-leader waits for a leader that the test stopped or killed
SIGNALS = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM, "INT": signal.SIGINT}
ROLES = ("leader", "nonleader", "worker", "main")
PHASES = ("startup", "attach", "write", "read")
# A single-process job has no attach phase: nobody attaches to its segment by name.
CELLS = [(r, p, s) for r in ROLES for p in PHASES for s in SIGNALS
         if not (r == "main" and p == "attach")]
# Cells that take longest: a rank waits out its timeout, or workers are spawned.
SLOW = {("leader", "startup"), ("leader", "attach"), ("worker", "attach")}


def _cell_params():
    for role, phase, sig in CELLS:
        marks = [pytest.mark.slow] if (role, phase) in SLOW or sig == "TERM" else []
        yield pytest.param(role, phase, sig, id=f"{role}-{phase}-{sig}", marks=marks)


def _leaves_a_file(role: str, phase: str, sig: str) -> bool:
    """Where the design leaves a name behind: a leader that dies without running its clean-up
    (SIGKILL, SIGTERM) before every local rank attached. SIGINT unwinds and removes it."""
    if sig == "INT":
        return False
    return (role == "leader" and phase in ("startup", "attach")) or \
        (role == "main" and phase == "startup")


def _stop_inside(proc, phase):
    """Bring a child to the middle of a write (its last slot) or of a read loop."""
    if phase == "write":
        proc.send(f"writehang {N - 1}")
        proc.expect("INSIDE")
    else:
        proc.send("readloop")
        proc.expect("READING")
        time.sleep(0.1)


def _run_ranks(role, phase, sig, shm, key, go, start):
    port = free_port()
    # The survivor's wait for a leader that never comes is what the leader cells check; the
    # other cells wait for a live leader, with a ceiling far above what that takes.
    wait = TIMEOUT if role == "leader" and phase in ("startup", "attach") else 60
    lead = start("rank0", rank_env(shm, key, rank=0, port=port, FT_GO=go, FT_TIMEOUT=wait))
    other = start("rank1", rank_env(shm, key, rank=1, port=port, FT_GO=go, FT_TIMEOUT=wait))
    target, survivor = (lead, other) if role == "leader" else (other, lead)
    if phase == "startup":
        lead.send("create pause_create")
        lead.expect("CREATING")
        other.send("create")
        other.expect("CONSTRUCTING")
        time.sleep(0.3)  # the leader is stopped: rank 1 can only be polling for its segment
        target.signal(SIGNALS[sig])
        if role == "nonleader":
            go.touch()
            lead.expect("ATTACHED")
    elif phase == "attach":
        lead.send("create")
        lead.expect("ATTACHED")
        if role == "leader":
            target.signal(SIGNALS[sig])
            assert target.wait() == -SIGNALS[sig]
            other.send("create")  # arrives after its leader died
        else:
            other.send("create pause_attach")
            other.expect("ATTACHING")
            target.signal(SIGNALS[sig])
    else:
        for c in (lead, other):
            c.send("create")
        for c in (lead, other):
            c.expect("ATTACHED")
            c.send("write")
        for c in (lead, other):
            c.expect("WROTE")
        _stop_inside(target, phase)
        target.signal(SIGNALS[sig])
    assert target.wait() == -SIGNALS[sig], target.stderr()

    if role == "leader" and phase in ("startup", "attach"):
        line = survivor.expect("ERROR", timeout=TIMEOUT + 60)
        assert "CacheTimeoutError" in line and "local rank 0" in line, line
        assert survivor.wait() == 3
        return
    if phase in ("startup", "attach"):
        survivor.send("write")
        survivor.expect("WROTE")
    survivor.send("fill")
    filled = survivor.expect("FILLED").split()[2:]
    if phase in ("write", "read"):
        # Index N-1 was never completed: the dead writer's slot is a miss and can be written
        # again without allow_overwrite (its lock died with it).
        assert filled == [str(N - 1)], filled
    survivor.send("check")
    assert survivor.expect("CHECK").split()[1:] == [str(N), "0", "0"]
    survivor.send("exit")
    survivor.expect("BYE")
    assert survivor.wait() == 0, survivor.stderr()


def _run_worker(phase, sig, shm, key, gate, start):
    main = start("main", rank_env(shm, key, FT_GATE=gate, FT_ITER_READY=gate.with_name("ready")))
    main.send("create")
    main.expect("ATTACHED")
    main.send(f"loader {'spawn' if phase == 'attach' else 'fork'} {phase}")
    marker = {"startup": "WSTARTING", "attach": "WATTACHING", "write": "WINSIDE",
              "read": "WREADING"}[phase]
    wpid = int(main.expect(marker, timeout=60).split()[1])
    os.kill(wpid, SIGNALS[sig])
    line = main.expect("DLERROR", timeout=60)
    # torch words it either way, depending on whether it saw the signal or only the exit
    assert f"{wpid}" in line and ("exited unexpectedly" in line or "killed by signal" in line), \
        line
    main.send("check")
    hits, misses, bad = main.expect("CHECK").split()[1:4]
    assert bad == "0"
    main.send("fill")
    filled = main.expect("FILLED").split()[2:]
    if phase == "write":
        assert "0" in filled, filled  # the worker died copying sample 0: a miss, writable
    main.send("check")
    assert main.expect("CHECK").split()[1:] == [str(N), "0", "0"]
    main.send("epoch")  # the survivor goes on: a new epoch with new workers
    assert main.expect("EPOCH").split()[1:] == [str(N), "0"]
    main.send("exit")
    main.expect("BYE")
    assert main.wait() == 0, main.stderr()


def _run_main(phase, sig, shm, key, go, start):
    main = start("main", rank_env(shm, key, FT_GO=go))
    if phase == "startup":
        main.send("create pause_create")
        main.expect("CREATING")
    else:
        main.send("create")
        main.expect("ATTACHED")
        main.send("write")
        main.expect("WROTE")
        _stop_inside(main, phase)
    main.signal(SIGNALS[sig])
    assert main.wait() == -SIGNALS[sig], main.stderr()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("role,phase,sig", list(_cell_params()))
def test_fault_cell(role, phase, sig, tmpfs, children, tmp_path):
    shm = tmpfs
    key = f"{role[0]}{phase[:2]}{sig}{os.getpid()}"
    go, gate = tmp_path / "go", tmp_path / "gate"
    if role in ("leader", "nonleader"):
        _run_ranks(role, phase, sig, shm, key, go, children)
        lws = 2
    elif role == "worker":
        _run_worker(phase, sig, shm, key, gate, children)
        lws = 1
    else:
        _run_main(phase, sig, shm, key, go, children)
        lws = 1

    # Every process of the job is gone: nothing maps or holds a file of the tmpfs.
    assert wait_until_unmapped(shm) == {"mapped by": {}, "held by": {}}

    left = [os.path.join(shm, n) for n in named(shm)]
    if _leaves_a_file(role, phase, sig):
        assert left, "expected the dead leader's file to be left for clean-up"
        if phase == "startup":
            assert all(p.endswith(".init") for p in left), left
        else:
            assert [os.path.basename(p) for p in left] == [f"stocaching_{os.getuid()}_{key}_n0_f"]
        # Stale once older than clean_segments' 2 s grace period (the survivor's wait may
        # already have taken that long; test_capacity_security checks the grace period):
        # listed as stale, and the next construction (the rerun) removes it.
        age(left)
        assert sorted(clean_segments(shm, dry_run=True)) == sorted(left)
        assert {s["path"]: s["state"] for s in list_segments(shm)} == \
            {p: "stale" for p in left}
    else:
        assert left == []
    rerun(shm, key, "f", N, D, lws)
    assert_no_leak(shm)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", ["KILL", "INT"])
def test_writer_dying_after_state_set_leaves_slot_writable(sig, tmpfs, children, tmp_path):
    """The docstring: "a slot whose writer died mid-write reads as empty and can be written
    again". Stop a writer between its last two stores (aux[i] = SET, then the even seq
    number), kill it, and write the slot from the other rank."""
    lead = ranks_with_a_killed_writer(children, tmpfs, f"late{sig}{os.getpid()}", N - 1,
                                      late=True, write_first=False, sig=SIGNALS[sig])
    lead.send("check")
    assert lead.expect("CHECK").split()[1:] == ["0", str(N), "0", *map(str, range(N))]
    lead.send("fill")
    assert lead.expect("FILLED").split()[1] == str(N)
    lead.send("exit")
    assert lead.wait() == 0
    assert_no_leak(tmpfs)


def _writer(cache, n, version_base, writing):
    torch.set_num_threads(1)  # as a DataLoader worker: the parent's OpenMP pool is not forked
    v = version_base
    while True:  # overwrite every slot, round and round, until killed
        for i in range(n):
            v = (v + 1) % 200
            cache.set_slot(i, _big(i, v), allow_overwrite=True)
            if not writing.is_set():
                writing.set()  # the kill's random delay counts from here


def _big(i, v, size=4 << 20):
    x = np.full(size, v + 1, dtype=np.uint8)
    x[:2] = i, v + 1
    return torch.from_numpy(x)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigkill_at_random_times_during_big_writes(tmpfs):
    """Without any wrapper: a forked writer overwrites 4 MiB slots in a loop and is SIGKILLed
    a random delay after its first write, 25 times (and on, up to 100 times, until 5 kills
    have landed inside a copy: a loaded machine may schedule the writer less, but each kill
    still lands where the writer was). Many kills land inside the copy (the slot is left
    "being written"); every index must then read as a miss or a complete value, and every
    slot must be writable again without allow_overwrite."""
    n, size = 6, 4 << 20
    rng = random.Random(1234)
    ctx = mp.get_context("fork")
    cache = SharedCache(1, n, (size,), name="big", job_key="bigkill", shm_dir=tmpfs)
    mid_write = rounds = 0
    try:
        for rnd in range(100):
            if rnd >= 25 and mid_write >= 5:
                break
            rounds += 1
            writing = ctx.Event()
            p = ctx.Process(target=_writer, args=(cache, n, rnd * 7, writing))
            p.start()
            assert writing.wait(120), f"round {rnd}: the writer never wrote"
            time.sleep(rng.uniform(0.02, 0.08))
            os.kill(p.pid, signal.SIGKILL)
            p.join(60)
            assert p.exitcode == -signal.SIGKILL
            aux = cache.aux_array.clone()
            mid_write += int((aux == 3).sum())
            for i in range(n):
                got = cache.get_slot(i)
                if got is None:
                    cache.set_slot(i, _big(i, 250))  # a dead writer's slot: writable again
                    got = cache.get_slot(i)
                    assert got is not None and torch.equal(got, _big(i, 250))
                else:
                    v = int(got[1])
                    assert int(got[0]) == i and torch.equal(got, _big(i, v - 1)), \
                        f"round {rnd}: index {i} is a mix of writes"
        print(f"\n[random kills] {mid_write} of {rounds} SIGKILLs landed inside a copy")
        assert mid_write >= 5, f"only {mid_write} of {rounds} kills landed inside a copy"
    finally:
        cache.close()
        del cache
    assert_no_leak(tmpfs)
