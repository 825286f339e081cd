"""Every fixture of the suite (the helpers are in _helpers.py):

* ``shm_dir``: a private directory on /dev/shm (a real tmpfs) for every test, so leak checks
  only see that test's segments;
* ``tmpfs``: a freshly mounted 64 MiB tmpfs, for capacity checks and leak checks that count the
  filesystem's bytes (skipped, with the reason, where ``mount`` is not allowed);
* ``children``: starts ``tests/children/job.py`` processes and kills what is left of them;

and Hypothesis's profile: derandomized, with no example database, so that CI sees what a
developer sees, and no deadline, so that no example fails by time. The inputs are the same on
every run of the same tests, not of one test alone: Hypothesis (6.170) also draws constants
found in the loaded modules of the project, so the whole suite, one file and ``-k`` give a test
different inputs. A fuzz test's asserted counts therefore hold with a wide margin in randomized
runs, not only in the derandomized one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile

import pytest
from hypothesis import settings

from _helpers import Child

SHM_ROOT = "/dev/shm"

settings.register_profile("stocaching", deadline=None, derandomize=True, database=None,
                          print_blob=False)
settings.load_profile("stocaching")


@pytest.fixture
def shm_dir(monkeypatch):
    """A fresh directory on /dev/shm (a real tmpfs); STOCACHING_SHM_DIR points child processes
    at it. Removed afterwards."""
    d = tempfile.mkdtemp(prefix="stocaching-test-", dir=SHM_ROOT)
    monkeypatch.setenv("STOCACHING_SHM_DIR", d)
    yield d
    shutil.rmtree(d, ignore_errors=True)


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


@pytest.fixture
def children(tmp_path):
    """Start job processes with ``children(label, env)``; any still running at the end are
    killed (only the process groups this fixture started)."""
    started: list[Child] = []

    def start(label: str, env: dict[str, str]) -> Child:
        c = Child(env, tmp_path / f"{label}.stderr", label)
        started.append(c)
        return c

    yield start
    for c in started:
        c.close()
