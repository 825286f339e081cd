"""The command line, ``python -m stocaching`` (``stocaching.stocaching.main``): the listing of
the segments, ``plan`` (of one tensor, of torch dtypes, of fields, and of a cache that would not
start), ``inspect`` of saved files, and errors, help and output as a script meets them. Tests of
a feature that take one step through the command line (``clean`` of start-up leftovers, of
persistent caches and of their disk tiers; ``plan`` of open sizes) are with that feature."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest

import stocaching
from _helpers import FIELD_DTYPES, FIELDS, FIELDS_ROW, budget_for, rank_env, saved_file
from stocaching import BYTES_PER_GIB, SharedCache, plan
from stocaching import cli

N = 40  # samples of the fields cache planned


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "stocaching", *args], capture_output=True,
                          text=True, env=rank_env(), timeout=60)


def _inspect(*args):
    return subprocess.run([sys.executable, "-m", "stocaching", "inspect", *map(str, args)],
                          capture_output=True, text=True, env=rank_env(), timeout=60)


# ----------------------------------------------------------------------------------------------
# The listing
# ----------------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_cli_info_lists_live_segments(shm_dir):
    c = SharedCache(1e-3, 64, (16,), shm_dir=shm_dir, name="shown")
    r = subprocess.run([sys.executable, "-m", "stocaching", "--shm-dir", shm_dir],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "free" in r.stdout and "RAM:" in r.stdout
    line = [ln for ln in r.stdout.splitlines() if "_shown" in ln]
    assert len(line) == 1 and "live" in line[0] and str(os.getpid()) in line[0] \
        and "(unlinked)" in line[0]
    # shown under the segment's name, not the leader's temporary one (<name>.<pid>.<hex>.init)
    assert line[0].endswith(f" {c._path} (unlinked)") and ".init" not in line[0]
    c.close()


# ----------------------------------------------------------------------------------------------
# plan
# ----------------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_cli_plan(shm_dir):
    r = subprocess.run([sys.executable, "-m", "stocaching", "plan", "--dataset-len", "1000",
                        "--dims", "3,32,32", "--size-gib", "0.001"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("349 of 1000 samples") and "34.9% of the dataset" in r.stdout
    assert stocaching.plan(1000, (3, 32, 32), size_limit_gib=0.001)["slots"] == \
        len(SharedCache(0.001, 1000, (3, 32, 32), shm_dir=shm_dir))
    bad = subprocess.run([sys.executable, "-m", "stocaching", "plan", "--dataset-len", "0",
                          "--dims", "3,32"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--dataset-len should be a positive int" in bad.stderr


def test_cli_plan_prints_the_budget_it_was_given_and_the_staging_slots_it_pays(shm_dir, capsys):
    # 0.005 GiB printed to two decimals read "0.01 GiB", twice the budget; staging slots cut
    # the slot count without a word
    args = ["--shm-dir", shm_dir, "plan", "--dataset-len", "1000", "--dims", "3,64,64",
            "--size-gib", "0.005"]
    assert cli.main(args) == 0
    alone = capsys.readouterr().out.splitlines()[0]
    assert cli.main(args + ["--staging-slots", "10"]) == 0
    staged = capsys.readouterr().out.splitlines()[0]
    assert alone == "436 of 1000 samples of (3, 64, 64) uint8 fit in 5.1 MiB: 43.6% of the dataset"
    assert staged == ("426 of 1000 samples of (3, 64, 64) uint8 fit in 5.1 MiB beside 10 staging "
                      "slots: 42.6% of the dataset")


def test_cli_plan_takes_torch_dtypes_and_says_when_it_does_not_fit(shm_dir):
    r = _cli("--shm-dir", shm_dir, "plan", "--dataset-len", "100", "--dims", "4",
             "--dtype", "torch.float16")
    assert r.returncode == 0 and "100 of 100 samples" in r.stdout and "warning" not in r.stdout
    free = os.statvfs(shm_dir).f_bavail * os.statvfs(shm_dir).f_frsize / BYTES_PER_GIB
    r = _cli("--shm-dir", shm_dir, "plan", "--dataset-len", str(int(2 * free * 1024) + 1024),
             "--dims", "1024,1024", "--size-gib", str(2 * free + 1))  # 1 MiB samples
    # the cache would refuse to start: an error, and a status a script can test
    assert r.returncode == 1 and "error: the segment" in r.stdout and \
        "the cache would refuse to start" in r.stdout


def test_the_command_line_plans_a_fields_cache(shm_dir, capsys):
    gib = budget_for(30, (FIELDS_ROW,), dataset_len=N)
    assert cli.main(["--shm-dir", shm_dir, "plan", "--dataset-len", str(N),
                      "--field", "image=3x8x8", "--field", "label=:int64",
                      "--field", "box=4:float32", "--size-gib", repr(gib)]) == 0
    assert capsys.readouterr().out.startswith(f"30 of {N} samples of image=3x8x8 + "
                                              "label=:int64 + box=4:float32 fit")
    with pytest.raises(SystemExit):
        cli.main(["plan", "--dataset-len", "10", "--field", "image=3x0"])
    assert "--field image should be a tuple of positive ints or None" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["plan", "--dataset-len", "10", "--dims", "3", "--field", "a=3"])
    assert "either --dims" in capsys.readouterr().err
    assert math.isclose(plan(N, FIELDS, FIELD_DTYPES, size_limit_gib=gib)["dataset_gib"],
                        N * (FIELDS_ROW + 1) / BYTES_PER_GIB)


# ----------------------------------------------------------------------------------------------
# inspect
# ----------------------------------------------------------------------------------------------


def test_the_cli_inspects_saved_files_and_says_which_are_damaged(shm_dir, tmp_path):
    path = saved_file(shm_dir, tmp_path)
    (tmp_path / "notes.txt").write_text("not a cache\n" * 1000)
    r = _inspect(tmp_path)  # a directory: its saved files (3 blocks of header, 32 rows of
    # 4 KiB, then their indices and the trailer in one more block: 144 KiB)
    assert r.returncode == 0, r.stderr
    assert r.stdout == (f"{path}: 144.0 KiB, saved 0.0 h ago\n"
                        f"  key='k1' dataset_len=64 data_dims=(4, 32, 32) dtype=uint8 node 0 "
                        f"of 1\n  32 samples to load (32 rows in 1 save)\n")
    data = bytearray(open(path, "rb").read())
    data[3 * 4096 + 4096 * 7 + 100] ^= 1  # a sample byte: only --verify reads it
    open(path, "wb").write(data)
    assert _inspect(path).returncode == 0
    r = _inspect("--verify", path, tmp_path / "notes.txt", tmp_path / "gone.stc")
    assert r.returncode == 1 and r.stdout.splitlines() == [
        f"{path}: {path} is damaged: the samples of the save record at byte 12288 fail their "
        "check; nothing of the file was loaded. Remove it (the next save writes it anew)",
        f"{tmp_path / 'notes.txt'}: not a file saved by SharedCache.save, or its header is "
        "damaged",
        f"{tmp_path / 'gone.stc'}: No such file or directory"]
    r = _inspect(shm_dir)
    assert r.returncode == 0 and r.stdout == f"{shm_dir}: no saved files\n"


# ----------------------------------------------------------------------------------------------
# Errors, help, and a closed pipe
# ----------------------------------------------------------------------------------------------


def test_cli_errors_name_its_own_flags_in_one_line():
    r = _cli("--shm-dir", "/no/such/dir")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--shm-dir should be an existing directory" in r.stderr.splitlines()[-1]
    r = _cli("plan", "--dataset-len", "10", "--dims", "3,4", "--size-gib", "-1")
    assert "--size-gib should be a positive finite number" in r.stderr and "Traceback" not in \
        r.stderr
    r = _cli("plan", "--dataset-len", "10", "--dims", "3,a")
    assert "--dims should be ints" in r.stderr


def test_the_help_of_every_option_is_written():
    for args in (("--help",), ("plan", "--help"), ("clean", "--help")):
        lines = _cli(*args).stdout.splitlines()
        for k, line in enumerate(lines):
            if re.match(r"^\s+--[\w-]+( [A-Z_]+)?\s*$", line):  # help, if any, on the next line
                nxt = lines[k + 1] if k + 1 < len(lines) else ""
                assert nxt.strip() and not nxt.strip().startswith("-"), \
                    f"{line.strip()} has no help in `python -m stocaching {' '.join(args)}`"


def test_cli_output_into_a_closed_pipe_ends_quietly(shm_dir):
    # `python -m stocaching plan ... | head -2`: the reader may be gone before the output is
    # written. Here it is gone before the process starts writing, so every run meets it.
    read, write = os.pipe()
    os.close(read)
    try:
        r = subprocess.run([sys.executable, "-m", "stocaching", "--shm-dir", shm_dir, "plan",
                            "--dataset-len", "100", "--dims", "4"], stdout=write,
                           stderr=subprocess.PIPE, text=True, env=rank_env(), timeout=60)
    finally:
        os.close(write)
    assert (r.returncode, r.stderr) == (0, "")
