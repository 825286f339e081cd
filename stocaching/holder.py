"""A cache kept for the restarts of a torchrun job: when torchrun's elastic agent restarts its
group of workers (``--max-restarts``), the restarted local leader finds the node's cache as
the failed attempt left it, and nothing is left once the agent is gone.

A feature module of stocaching (see the core's section "The seam"). Under torchrun's agent
(``TORCHELASTIC_RUN_ID`` set), the local leader's ``Segment`` is opened by ``open_kept``
here instead of being made: it adopts the segment a holder keeps for this agent if that
segment holds this cache's configuration, else makes a new one and starts its holder.

The holder is this file run as a program (``python -I -S holder.py ...``, standard library
only: it imports neither torch nor the core), in a session of its own and without the
launcher's stdio. It holds the segment's descriptor (and so its shared flock: the
leader's open file, passed on), and hands a copy of it over a Unix socket in the abstract
namespace, named by the agent (its pid and start time, the run id) rather than by the
attempt, to a process of the same user that asks. It exits when the agent exits, when
asked to let go (a restarted leader that cannot use the segment, or the leader's
``close()``), or on SIGTERM; the kernel removes its socket's name with it, so nothing of
it is ever left in /dev/shm. See docs/design.md, "A cache kept across torchrun's
restarts", for the lifecycle and its failure modes.
"""

from __future__ import annotations

__all__: list = []
STOCACHING_FEATURE = "holder"  # (the core reads this line before it imports the file)

import fcntl
import hashlib
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from typing import Any

if __name__ != "__main__":  # (the holder itself runs this file with the standard library only)
    import weakref

    import numpy as np

    try:  # inside the package
        from .stocaching import (SEGMENT_PREFIX, SET, BaseCache, Segment, close_fd,
                                 finalize_segment, logger, process_start, pwrite_all)
    except ImportError:  # copied beside stocaching.py
        from stocaching import (SEGMENT_PREFIX, SET, BaseCache, Segment, close_fd,
                                finalize_segment, logger, process_start, pwrite_all)

_POLL_SECONDS = 1.0  # how often the holder looks at the agent without a pidfd
_ANSWER_SECONDS = 5.0  # how long either side waits for the other's message
_GONE_WAIT = 5.0  # how long a leader waits for the holder of a segment it replaces to exit
_LISTENING_WAIT = 10.0  # how long a leader waits for the holder it started to listen
# Process-wide by nature: the holders this process started, polled (reaped once they exit)
# rather than left as zombies while this process lives.
_HOLDERS: list = []


# -- the local leader ---------------------------------------------------------------------------


def _agent() -> tuple[int, int]:
    """The elastic agent: this process's parent (torchrun starts its workers as its children),
    as (pid, process start)."""
    pid = os.getppid()
    return pid, process_start(pid)


def holder_address(owner: BaseCache, env: Any = None) -> str:
    """The abstract socket name of the holder of ``owner``'s segment: one per user, agent
    (its pid and start time: a pid reused later has another; the run id; SLURM's job and
    step) and cache name, whatever the attempt and the node rank (which the header holds)."""
    env = os.environ if env is None else env
    pid, start = _agent()
    parts = [str(pid), str(start)] + [env.get(k, "") for k in
                                      ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_STEP_ID")]
    key = hashlib.sha1("|".join(parts).encode()).hexdigest()[:12]
    return f"{SEGMENT_PREFIX}-held-{os.getuid()}-{key}-{owner._name}"


def open_kept(segment: Segment, owner: BaseCache, load_from: str | None = None) -> None:
    """The local leader under torchrun's agent: attach to the segment the holder of an earlier
    attempt keeps, if it holds this configuration, else make one (filled from ``load_from``)
    and start its holder. A segment kept for another configuration (another node count,
    node rank, size or dims: an elastic resize, a changed script) is let go, never an
    error."""
    address = holder_address(owner)
    fd = _ask(address, b"open")
    if fd is not False:  # (a descriptor; False is no holder, and an int too: not isinstance)
        if _adopt(segment, owner, fd):
            segment.release = _release_on_close(segment, address)
            if load_from is not None:
                logger.info("stocaching: the cache %r was kept from the attempt before: "
                            "attached to it as it is, without reading %s", owner._name,
                            load_from)
            return
        _ask(address, b"go")
    segment.make(owner, load_from)
    try:
        _start_holder(segment, address)
    except OSError as e:  # (no holder: this attempt's cache is not kept, as without this file)
        logger.warning("stocaching: could not start the process that keeps the cache %r for a "
                       "restart (%s); a restart of this job starts it empty", owner._name, e)
        return
    segment.release = _release_on_close(segment, address)


def _adopt(segment: Segment, owner: BaseCache, fd: int) -> bool:
    """Attach to the segment open at ``fd`` (the holder's copy), as its local leader, if it
    holds this cache's configuration; False (``fd`` closed, nothing mapped) otherwise."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        if owner._auto_sized:  # its size was chosen with this memory free: keep it
            owner._slots_from_leader = True
        try:
            head = segment.map_existing(owner, fd)
        finally:
            owner._slots_from_leader = False
    except Exception as e:  # another configuration (a resize, a changed script): a new one
        segment.unmap()
        segment.mapping = segment.read_only_mapping = None
        os.close(fd)
        logger.info("stocaching: the cache kept from the attempt before does not fit this "
                    "one (%s): making a new one", e)
        return False
    # The processes of the attempt before are gone: what they had staged is nobody's, and
    # this attempt's local ranks count themselves in anew.
    if owner._staging_slots:
        pwrite_all(fd, np.full(owner._staging_slots, -1, np.int64), head["stage_off"])
    segment.header_set("attached", 1)
    segment.header_set("local_world_size", owner._world.local_world_size)
    shared = owner._world.local_world_size > 1
    if shared:  # (the file may have no name left to link: a pointer names it, as for memfd)
        segment._publish_pointer(owner, fd)
    dev, ino = segment.name_id
    segment.finalizer = weakref.finalize(
        segment, finalize_segment, fd, segment.path if shared else None, ino, dev,
        os.getpid(), owner._timeout if shared else 0.0, segment.pointer_fd)
    segment.populate(head["data_off"])
    logger.info("stocaching: attached to the cache %r kept from the attempt before (restart "
                "%s): %d of %d slots filled", owner._name,
                os.environ.get("TORCHELASTIC_RESTART_COUNT", "?"),
                int(np.count_nonzero(owner._index_states_np == SET)), owner._layout.slots)
    return True


def _release_on_close(segment: Segment, address: str) -> weakref.finalize:
    """What the leader's ``close()`` does besides closing: ask the holder to let go (not at
    exit: a restart is what it keeps the segment for)."""
    release = weakref.finalize(segment, _ask, address, b"go")
    release.atexit = False
    return release


def _ask(address: str, request: bytes) -> int | bool:
    """Send ``request`` to the holder at ``address``: b"open" returns a descriptor of its
    segment, b"go" waits (a moment) for it to exit; False where no holder answers."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    s.settimeout(_ANSWER_SECONDS)
    with s:
        try:
            s.connect("\0" + address)
            holder = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                      12))
            if holder[1] != os.getuid():
                return False  # (not ours: never take a descriptor from it)
            s.sendall(request)
            if request == b"open":
                _, fds, _, _ = socket.recv_fds(s, 16, 1)
                return fds[0] if fds else False
            s.recv(1)  # (its end closes as it goes)
        except OSError:
            return False
    start, deadline = process_start(holder[0]), time.monotonic() + _GONE_WAIT
    while start and process_start(holder[0]) == start and time.monotonic() < deadline:
        time.sleep(0.01)  # its memory is free once it is gone
    return True


def _start_holder(segment: Segment, address: str) -> None:
    """Start the holder of the segment just made, with its descriptor (the same number)."""
    agent_pid, agent_start = _agent()
    # A copy above the standard streams' numbers (a launcher may start its workers with stdin
    # closed, and the segment's descriptor is then 0, which the child's stdin would replace).
    fd = fcntl.fcntl(segment.fd, fcntl.F_DUPFD_CLOEXEC, 3)
    listening, told = os.pipe()  # the holder writes a byte once it listens
    try:
        holder = subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.abspath(__file__), str(agent_pid),
             str(agent_start), address, str(fd), str(told)],
            pass_fds=(fd, told), start_new_session=True, close_fds=True, cwd="/",
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    finally:
        close_fd(fd)
        close_fd(told)
    # Return once it listens (or has given up: the pipe's end), so that a close() right after
    # this construction finds it to let go; otherwise its b"go" would find nobody, and the
    # holder would keep the segment, and its memory, until the agent exits.
    try:
        if select.select([listening], [], [], _LISTENING_WAIT)[0]:
            os.read(listening, 1)
    finally:
        close_fd(listening)
    _HOLDERS[:] = [h for h in _HOLDERS if h.poll() is None] + [holder]


# -- the holder ---------------------------------------------------------------------------------


def _start_of(pid: int) -> int:
    """``pid``'s start time in clock ticks since boot, or 0 where it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def hold(agent_pid: int, agent_start: int, address: str, fd: int, told: int) -> None:
    """The holder's life: keep ``fd`` open and hand copies of it to this user's processes
    that ask at ``address``, until the agent exits or one asks it to let go. A byte on
    ``told`` tells the leader that started it that it listens."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a terminal's ^C: the agent's to handle)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        listener.bind("\0" + address)
    except OSError:  # another holder has the name: that one keeps its segment
        os.close(told)
        return
    listener.listen(8)
    os.write(told, b"1")
    os.close(told)
    try:
        agent = os.pidfd_open(agent_pid)
    except (OSError, AttributeError):  # (Linux < 5.3: look at /proc instead)
        agent = None
    while _start_of(agent_pid) == agent_start:
        ready = select.select([listener] + ([agent] if agent is not None else []), [], [],
                              _POLL_SECONDS)[0]
        if agent in ready:
            return  # it exited
        if listener in ready and _answer(listener, fd) == b"go":
            return


def _answer(listener: socket.socket, fd: int) -> bytes:
    """Answer one request: b"open" gets a copy of ``fd``; returns the request."""
    conn, _ = listener.accept()
    with conn:
        conn.settimeout(_ANSWER_SECONDS)
        try:
            uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                      12))[1]
            request = conn.recv(16) if uid == os.getuid() else b""
            if request == b"open":
                socket.send_fds(conn, [b"fd"], [fd])
        except OSError:
            return b""
    return request


if __name__ == "__main__":
    hold(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
