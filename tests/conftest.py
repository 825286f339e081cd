"""Shared fixtures: a private directory on a real tmpfs for every test, so leak checks only see
that test's segments, and a helper that lists what is left in it."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import pytest

SHM_ROOT = "/dev/shm"


@pytest.fixture
def shm_dir(monkeypatch):
    """A fresh directory on /dev/shm (a real tmpfs); STOCACHING_SHM_DIR points child processes
    at it. Removed afterwards."""
    d = tempfile.mkdtemp(prefix="stocaching-test-", dir=SHM_ROOT)
    monkeypatch.setenv("STOCACHING_SHM_DIR", d)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 64 MiB tmpfs mounted for this test (needs root; skipped where mounting is refused)."""
    d = tmp_path / "tmpfs"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=1777", "tmpfs", str(d)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield str(d)
    finally:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def leftovers(d: str) -> list[str]:
    """stocaching files left in ``d``."""
    return sorted(f for f in os.listdir(d) if f.startswith("stocaching_"))


def mappers(d: str) -> list[int]:
    """pids of processes that still map a segment from ``d`` (named or unlinked)."""
    real = os.path.realpath(d)
    pids = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/maps") as f:
                    if any(real + "/stocaching_" in ln for ln in f):
                        pids.append(int(p))
            except OSError:
                pass
    return pids
