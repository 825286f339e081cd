"""``python -m benchmark peers`` on tiny sizes: every arm either reports a warm rate or is listed
as skipped with its install command (CI has webdataset only among the peers), the target lines
are printed, and the peers' files and the caches are gone afterwards."""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

import pytest

from benchmark import peers


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    peers.add_arguments(p)
    return p.parse_args(list(argv))


def test_defaults():
    a = _args()
    assert (a.num_images, a.decoded_size, a.workers, a.batch_size, a.repeats, a.epochs,
            a.min_seconds, a.threads) == (6000, 128, 2, 64, 3, 1, 1.0, None)
    assert a.arms == list(peers.ARMS) and a.plot
    with pytest.raises(SystemExit):
        _args("--arms", "nope")


@pytest.mark.timeout(60)
def test_every_arm_runs_or_says_how_to_install_it(tmp_path, shm_dir):
    out = tmp_path / "out"
    lines: list[str] = []
    argv = ["--num-images", "64", "--image-size", "64", "--decoded-size", "32", "--batch-size",
            "16", "--workers", "1", "--repeats", "1", "--min-seconds", "0", "--data-dir",
            str(tmp_path / "jpegs"), "--out", str(out)]
    rc = peers.main(_args(*argv), ["peers", *argv], lines.append)
    assert rc == 0
    text = "\n".join(lines)
    rows = {m[0]: m[1] for m in re.findall(r"^\| (\w+) \| (.*) \|$", text, re.M)}
    assert set(rows) >= set(peers.ARMS), text
    for arm in peers.ARMS:
        cells = [c.strip() for c in rows[arm].split(" | ")]
        peer = peers.ARM_CLASSES[arm].peer
        if peer is not None and cells[-1].startswith("skipped"):
            assert cells[-1] == f"skipped (not installed: {peers.PEERS[peer][1]})", text
            continue
        if peer is not None and cells[-1].startswith(f"failed: import {peers.PEERS[peer][0]}"):
            # A peer installed but broken (a torchvision built for another torch, say): the
            # run names it and how to mend it, and goes on. Not a stocaching arm.
            assert peers.PEERS[peer][1] in cells[-1], text
            continue
        loader_only, augment = (float(c.split(" (")[0].replace(",", "")) for c in cells[2:4])
        assert loader_only > 0 and augment > 0, (arm, text)
    checks = re.findall(r"^\[(PASS|MISS|SKIP)\] (.*)$", text, re.M)
    assert len(checks) == 2, text
    if "skipped" in rows["ffcv"]:
        assert all(c == ("SKIP", c[1]) and c[1].startswith("ffcv not installed") for c in checks)
    assert re.search(r"^stocaching_dataloader against each arm, .*decode_every_epoch [\d.]+ x",
                     text, re.M), text
    result = json.loads((out / "results.json").read_text())
    assert set(result["arms"]) == set(peers.ARMS)
    assert sorted(os.listdir(out)) == ["peers.png", "results.json"]  # the peers' files are gone
    assert os.listdir(shm_dir) == []


def test_mosaicmls_augmenting_arm_reads_the_shards_under_a_relative_out(tmp_path, monkeypatch):
    """The augmenting MosaicML arm's second local directory, a link to the written shards,
    resolves to them when ``--out`` is relative (its default), from any working directory: a
    relative link target would be resolved from the link's folder. Needs no streaming."""
    monkeypatch.chdir(tmp_path)
    work = Path("out") / "peers-files-x"  # as main() makes it under a relative --out
    (work / "mds").mkdir(parents=True)
    (work / "mds" / "index.json").write_text('{"shards": []}')
    data = peers.Data(root=Path("jpegs"), images=None, labels=None, num_classes=10, work=work,
                      workers=1, batch_size=16, seed=0, threads=1)
    arm = peers.MosaicML(data)
    arm.dir = work / "mds"  # what prepare() sets, without writing through streaming
    local = arm.augment_dir()
    assert (local / "index.json").read_text() == '{"shards": []}'
    monkeypatch.chdir("/")
    assert (tmp_path / local / "index.json").read_text() == '{"shards": []}'
