"""Helpers for the reliability tests (faults, capacity and security, concurrency, endurance).

Not a test module: pytest collects ``test_*.py`` only. It provides

* ``tmpfs``: a fixture mounting a fresh 64 MiB tmpfs per test, so that leak checks look at a
  directory nobody else uses (skipped, with the reason, where ``mount`` is not allowed);
* ``Child``: a process started the way ``torchrun`` starts a local rank
  (``subprocess.Popen([sys.executable, script])`` with the rank variables in its environment),
  driven by one command per line on stdin and answering with progress markers on stdout;
* ``JOB_SCRIPT``: the child program, written to ``tmp_path`` by the tests;
* leak probes that read /proc: who maps or holds a file of a directory, and how much of a tmpfs
  is still in use.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from stocaching import SharedCache, World
from stocaching.stocaching import SEGMENT_PREFIX

REPO = Path(__file__).resolve().parent.parent
_PORTS = itertools.count(29500 + os.getpid() % 1000 * 20)


# ----------------------------------------------------------------------------------------------
# A private tmpfs per test
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def tmpfs():
    """Mount a fresh 64 MiB tmpfs and yield its path; unmount and remove it afterwards.

    The mount point is a new directory in the system temp dir with mode 0755 (pytest's
    ``tmp_path`` is private to root), so that a child running as another user can reach the
    tmpfs, whose own mode is 1777 like /dev/shm."""
    d = tempfile.mkdtemp(prefix="reliability-shm-")
    os.chmod(d, 0o755)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=1777", "tmpfs", d],
                       capture_output=True, text=True)
    if r.returncode != 0:
        os.rmdir(d)
        pytest.skip(f"cannot mount a private tmpfs here ({r.stderr.strip() or r.returncode}); "
                    "these tests need root or CAP_SYS_ADMIN to isolate their leak checks")
    try:
        yield os.path.realpath(d)
    finally:
        if subprocess.run(["umount", d], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", d], capture_output=True)
        with contextlib.suppress(OSError):
            os.rmdir(d)


# ----------------------------------------------------------------------------------------------
# Leak probes
# ----------------------------------------------------------------------------------------------


def named(shm_dir: str) -> list[str]:
    """Names in ``shm_dir`` that carry the stocaching prefix."""
    return sorted(n for n in os.listdir(shm_dir) if n.startswith(SEGMENT_PREFIX))


def mappers(shm_dir: str) -> dict[int, list[str]]:
    """Processes that map a file of ``shm_dir`` (named or already unlinked), from /proc."""
    prefix = os.path.realpath(shm_dir) + "/"
    out: dict[int, list[str]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                hits = sorted({ln.split(maxsplit=5)[5].strip() for ln in f if prefix in ln})
        except (OSError, IndexError):
            continue
        if hits:
            out[int(pid)] = hits
    return out


def holders(shm_dir: str) -> dict[int, list[str]]:
    """Processes with an open descriptor on a file of ``shm_dir``, from /proc/*/fd."""
    prefix = os.path.realpath(shm_dir) + "/"
    out: dict[int, list[str]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(prefix):
                out.setdefault(int(pid), []).append(target)
    return out


def used_bytes(shm_dir: str) -> int:
    """Bytes in use on the tmpfs: files still named *and* unlinked files someone still holds."""
    st = os.statvfs(shm_dir)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def assert_no_leak(shm_dir: str, *, within: float = 10.0) -> None:
    """Nothing named, mapped or held in ``shm_dir`` and its memory returned, within ``within`` s
    (processes that were just killed, and DataLoader workers, take a moment to go)."""
    deadline = time.monotonic() + within
    while True:
        state = {"named": named(shm_dir), "mapped by": mappers(shm_dir),
                 "held by": holders(shm_dir), "bytes used": used_bytes(shm_dir)}
        if not any(state.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"leak in {shm_dir}: {state}")
        time.sleep(0.05)


def age(paths, seconds: float = 10.0) -> None:
    """Make files look ``seconds`` old: ``clean_segments`` leaves files younger than 2 s alone
    (a leader may be creating them), so this stands for the time a relaunch takes."""
    t = time.time() - seconds
    for p in paths:
        os.utime(p, (t, t), follow_symlinks=False)


# ----------------------------------------------------------------------------------------------
# Values: a function of the index, the same in the test and in its children
# ----------------------------------------------------------------------------------------------


def pattern(i: int, d: int) -> torch.Tensor:
    """The value stored for index ``i``: no two indices share one, and none is all zeros."""
    return ((torch.arange(d) * 13 + i * 7 + 1) % 251).to(torch.uint8)


def rerun(shm_dir: str, job_key: str, name: str, n: int, d: int, local_world_size: int) -> None:
    """Run the same job again, right away, in this process: the leader and (if any) the other
    local rank construct, one writes, the other reads everything back, both close."""
    worlds = [World(rank=r, world_size=local_world_size, local_rank=r,
                    local_world_size=local_world_size) for r in range(local_world_size)]
    caches = [SharedCache(1, n, (d,), name=name, job_key=job_key, world=w, shm_dir=shm_dir,
                          timeout=5) for w in worlds]
    try:
        for i in range(n):
            caches[0].set_slot(i, pattern(i, d))
        for i in range(n):
            got = caches[-1].get_slot(i)
            assert got is not None and torch.equal(got, pattern(i, d)), f"rerun: index {i}"
    finally:
        for c in caches:
            c.close()


# ----------------------------------------------------------------------------------------------
# Child processes
# ----------------------------------------------------------------------------------------------


def job_env(shm_dir: str, job_key: str, *, rank: int | None = None, world_size: int = 2,
            port: int | None = None, **extra: str) -> dict[str, str]:
    """Environment of a child: torchrun's variables when ``rank`` is given (else a plain
    single-process job), our job key and tmpfs, and this checkout on the path."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                        "GROUP_WORLD_SIZE", "SLURM_PROCID", "MASTER_PORT", "MASTER_ADDR")}
    env.update(STOCACHING_JOB_KEY=job_key, STOCACHING_SHM_DIR=shm_dir,
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    if rank is not None:
        env.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port if port is not None else next(_PORTS)))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def new_port() -> int:
    return next(_PORTS)


class Child:
    """A child process: commands go to its stdin, its stdout lines are collected by a thread."""

    def __init__(self, script: Path, env: dict[str, str], log: Path, label: str) -> None:
        self.label = label
        self.log = log
        self._err = open(log, "wb")
        self.p = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=self._err, env=env,
                                  cwd=script.parent, text=True, bufsize=1,
                                  start_new_session=True)
        self.pid = self.p.pid
        self.lines: list[str] = []
        self._q: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.p.stdout:
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    def stderr(self) -> str:
        self._err.flush()
        return self.log.read_text(errors="replace")[-3000:]

    def expect(self, prefix: str, timeout: float = 30.0) -> str:
        """The next stdout line starting with ``prefix`` (others are kept in ``lines``)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._q.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                self.dump_stacks()
                raise AssertionError(f"{self.label}: no {prefix!r} within {timeout} s; stdout "
                                     f"{self.lines}; stderr:\n{self.stderr()}") from None
            if line is None:
                self._q.put(None)
                raise AssertionError(f"{self.label}: exited (rc={self.p.poll()}) before "
                                     f"{prefix!r}; stdout {self.lines}; stderr:\n"
                                     f"{self.stderr()}")
            self.lines.append(line)
            if line.startswith(prefix):
                return line
            if line.startswith("NOREADY"):
                raise AssertionError(f"{self.label}: a worker waited 30 s for iter(loader) to "
                                     f"return; stdout {self.lines}")

    def dump_stacks(self) -> None:
        """Ask a stuck child for the Python stack of every thread (to its stderr, via
        faulthandler), so that a hang reports where it hangs."""
        if self.p.poll() is None:  # the child and its DataLoader workers (its session)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGUSR1)
            time.sleep(0.5)

    def send(self, command: str) -> None:
        self.p.stdin.write(command + "\n")
        self.p.stdin.flush()

    def wait(self, timeout: float = 30.0) -> int:
        """Return code; a child still running after ``timeout`` s is a hang: fail."""
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.dump_stacks()
            self.kill_group()
            raise AssertionError(f"{self.label} hung: still running {timeout} s later; stdout "
                                 f"{self.lines}; stderr:\n{self.stderr()}") from None

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def kill_group(self) -> None:
        """SIGKILL the session this child leads (it and the DataLoader workers it started)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.p.wait(5)

    def close(self) -> None:
        self.kill_group()  # also when it has exited: its workers may outlive it for a moment
        for s in (self.p.stdin, self.p.stdout):
            with contextlib.suppress(Exception):
                s.close()
        self._err.close()


@pytest.fixture
def children(tmp_path):
    """Start children with ``children(label, env)``; any still running at the end are killed
    (only the process groups this fixture started)."""
    started: list[Child] = []
    script = tmp_path / "job.py"
    script.write_text(JOB_SCRIPT)

    def start(label: str, env: dict[str, str]) -> Child:
        c = Child(script, env, tmp_path / f"{label}.stderr", label)
        started.append(c)
        return c

    yield start
    for c in started:
        c.close()


# The child. It reads one command per line:
#   create [pause_create|pause_attach]   construct the cache ("ATTACHED" or "ERROR <type> ...")
#   write                 set this rank's share (i % local_world_size == local_rank, but the last)
#   writehang I           set_slot(I) and stop halfway through copying the bytes
#   writehang_late I      set_slot(I) and stop right after aux[I] = SET, before the seq update
#   readloop              read everything forever, checking every value
#   fill                  set every index that reads as a miss, without allow_overwrite
#   check                 read everything: "CHECK hits misses bad"
#   loader CTX PHASE      one DataLoader epoch, 2 workers; worker 0 stops at PHASE
#   epoch                 one clean DataLoader epoch (fork), checking every sample
#   exit                  close and exit 0
# A stop prints "<MARKER> <pid>" and waits for the file $FT_GO (or forever).
JOB_SCRIPT = r'''
import faulthandler
import functools
import os
import signal
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from stocaching import SharedCache
from stocaching import stocaching as core

N = int(os.environ.get("FT_N", "32"))
D = int(os.environ.get("FT_D", "1024"))
GO = os.environ.get("FT_GO", "")
GATE = os.environ.get("FT_GATE", "")
# Created by the main process once iter(DataLoader) has returned. Workers wait for it before
# they announce a stop, so that the test's signal never reaches the main process while it is
# still inside torch's DataLoader set-up: torch's SIGCHLD handler raises from wherever the
# main thread is, and raised inside multiprocessing.Queue.put (a threading.Condition entered,
# not yet exited) it leaves that queue's lock held, and the iterator's own shutdown then
# deadlocks on it. That is torch's hazard, not the cache's; this test is about the cache.
ITER_READY = os.environ.get("FT_ITER_READY", "")
TIMEOUT = float(os.environ.get("FT_TIMEOUT", "2"))
LOCAL_RANK = int(os.environ.get("LOCAL_RANK", "0"))
LWS = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
# Ctrl-C behaves as in a terminal even when the test runner was started with SIGINT ignored
# (a shell does that to a command run with '&'), a disposition children would inherit.
signal.signal(signal.SIGINT, signal.default_int_handler)
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for stacks on a hang


def say(*a):
    print(*a, flush=True)


def pattern(i):
    return ((torch.arange(D) * 13 + i * 7 + 1) % 251).to(torch.uint8)


def wait_iter_ready():
    deadline = time.monotonic() + 30
    while ITER_READY and not os.path.exists(ITER_READY):
        if time.monotonic() > deadline:
            say("NOREADY", os.getpid())  # the test fails on this line, not on a timeout
            os._exit(7)
        time.sleep(0.01)


def hold(marker, after_iter=False):
    if after_iter:
        wait_iter_ready()
    say(marker, os.getpid())
    while not (GO and os.path.exists(GO)):
        time.sleep(0.01)


def arm_create():
    real = os.posix_fallocate

    def fallocate(fd, offset, length):  # the leader stops once the file exists, full size
        real(fd, offset, length)
        hold("CREATING")
    os.posix_fallocate = fallocate


def arm_attach():
    real = SharedCache._check_header

    def check_header(self, head, size):  # holds the segment's flock and mapping here
        real(self, head, size)
        hold("ATTACHING")
    SharedCache._check_header = check_header


class MidCopy:
    """Stands in for cache._np_slots in the writer: stops with half of the bytes copied."""

    def __init__(self, real, marker, after_iter=False):
        self.real, self.marker, self.after_iter = real, marker, after_iter

    def __getitem__(self, k):
        return self.real[k]

    def __setitem__(self, k, v):
        h = D // 2
        self.real[k][:h] = v[:h]
        hold(self.marker, self.after_iter)
        self.real[k][h:] = v[h:]


class AfterSet:
    """Stands in for cache._aux_mv in the writer: stops right after the state becomes SET."""

    def __init__(self, real, marker):
        self.real, self.marker = real, marker

    def __getitem__(self, k):
        return self.real[k]

    def __setitem__(self, k, v):
        self.real[k] = v
        if v == core.SET:
            hold(self.marker)


def scan(cache):
    hits = misses = bad = 0
    missing = []
    for i in range(N):
        v = cache.get_slot(i)
        if v is None:
            misses += 1
            missing.append(i)
        elif torch.equal(v, pattern(i)):
            hits += 1
        else:
            bad += 1
    return hits, misses, bad, missing


class Gate:
    """Unpickled after the cache in a spawned worker: the first worker to get here stops."""

    def __reduce__(self):
        return _gate, ()


def _gate():
    if GATE:
        try:
            os.close(os.open(GATE, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            pass
        else:
            hold("WATTACHING", after_iter=True)
    return None


class DS(Dataset):
    def __init__(self, cache, phase):
        self.cache = cache  # pickled first, so a spawned worker has mapped it at the Gate
        self.phase = phase
        self.gate = Gate() if phase == "attach" else None

    def __len__(self):
        return N

    def __getitem__(self, i):
        info = get_worker_info()
        if info is not None and info.id == 0 and i == 0:
            if self.phase == "write":
                self.cache._np_slots = MidCopy(self.cache._np_slots, "WINSIDE", True)
            elif self.phase == "read":
                wait_iter_ready()
                say("WREADING", os.getpid())
                while True:
                    if scan(self.cache)[2]:
                        os._exit(4)
        x = self.cache.get_slot(i)
        if x is None:
            x = pattern(i)
            self.cache.set_slot(i, x)
        return x


def init_worker(phase, worker_id):
    if phase == "startup" and worker_id == 0:
        hold("WSTARTING", after_iter=True)


def epoch(cache, ctx="fork", phase="none", timeout=0):
    dl = DataLoader(DS(cache, phase), batch_size=4, num_workers=2, multiprocessing_context=ctx,
                    worker_init_fn=functools.partial(init_worker, phase), timeout=timeout)
    if ITER_READY and os.path.exists(ITER_READY):
        os.unlink(ITER_READY)
    it = iter(dl)  # starts the workers and queues their first batches
    if ITER_READY:
        open(ITER_READY, "w").close()
    seen = bad = 0
    for b, batch in enumerate(it):
        for j, x in enumerate(batch):
            seen += 1
            bad += not torch.equal(x, pattern(4 * b + j))
    return seen, bad


def main():
    cache = None
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "create":
            if "pause_create" in args:
                arm_create()
            if "pause_attach" in args:
                arm_attach()
            say("CONSTRUCTING", os.getpid())
            try:
                cache = SharedCache(1, N, (D,), name="f", timeout=TIMEOUT)
            except Exception as e:
                say("ERROR", type(e).__name__, str(e).replace("\n", " "))
                sys.exit(3)
            say("ATTACHED", len(cache))
        elif cmd == "write":
            n = 0
            for i in range(N - 1):
                if i % LWS == LOCAL_RANK:
                    cache.set_slot(i, pattern(i))
                    n += 1
            say("WROTE", n)
        elif cmd == "writehang":
            cache._np_slots = MidCopy(cache._np_slots, "INSIDE")
            cache.set_slot(int(args[0]), pattern(int(args[0])))
        elif cmd == "writehang_late":
            cache._aux_mv = AfterSet(cache._aux_mv, "INSIDE")
            cache.set_slot(int(args[0]), pattern(int(args[0])))
        elif cmd == "readloop":
            say("READING", os.getpid())
            while True:
                if scan(cache)[2]:
                    say("BAD")
                    sys.exit(4)
        elif cmd == "fill":
            filled = []
            for i in range(N):
                if cache.get_slot(i) is None:
                    try:
                        cache.set_slot(i, pattern(i))
                    except Exception as e:
                        say("ERROR", type(e).__name__, str(e).replace("\n", " "))
                        sys.exit(5)
                    filled.append(i)
            say("FILLED", len(filled), *filled)
        elif cmd == "check":
            hits, misses, bad, missing = scan(cache)
            say("CHECK", hits, misses, bad, *missing)
        elif cmd == "loader":
            ctx, phase = args
            try:
                seen, bad = epoch(cache, ctx, phase, timeout=20 if ctx == "spawn" else 2)
                say("EPOCH", seen, bad)
            except RuntimeError as e:
                say("DLERROR", str(e).replace("\n", " "))
        elif cmd == "epoch":
            seen, bad = epoch(cache)
            say("EPOCH", seen, bad)
        elif cmd == "exit":
            if cache is not None:
                cache.close()
            say("BYE")
            return


if __name__ == "__main__":
    main()
'''
