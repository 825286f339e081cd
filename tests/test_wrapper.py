"""CachedDataset: a map-style dataset someone else wrote, cached without editing it (a class
of ours that stands for a library's, and a real Hugging Face ``datasets`` imagefolder), through
DataLoader workers, torchrun ranks, the samplers and loaders of stocaching."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from _helpers import CHILDREN, assert_no_leak, free_port, named, rank_env, run_copied
from stocaching import (CacheAwareSampler, CachedDataset, DeviceLoader, OpenSizeCache,
                        Prefetcher, SharedCache)

N = 40
SIZE = 16  # the side decode resizes to


class LibraryDataset(torch.utils.data.Dataset):
    """A dataset we pretend not to own: items (uint8 image, int label), or with ``random`` a
    random transform inside it (what must not be cached)."""

    def __init__(self, n: int = N, random: bool = False, as_numpy: bool = False) -> None:
        self.n, self.random, self.as_numpy = n, random, as_numpy

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        image = ((torch.arange(3 * 8 * 8) * 7 + i * 13) % 251).to(torch.uint8).reshape(3, 8, 8)
        if self.random:  # (noise: two draws are never the same)
            image = image ^ torch.randint(1, 256, image.shape, dtype=torch.uint8)
        if self.as_numpy:
            return {"image": image.numpy(), "label": np.int64(i % 5), "weight": 0.5}
        return image, i % 5


def flip_first(value):
    """A transform after the cache: flip the image (deterministic here, so tests can check)."""
    image, label = value
    return image.flip(-1), label


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_a_dataset_it_did_not_write_is_cached_and_served_through_workers(shm_dir, start):
    base = LibraryDataset()
    ds = CachedDataset(base, transform=flip_first, size_limit_gib=1)
    assert ds.cache.fields == ("item0", "item1") and len(ds.cache) == N and len(ds) == N
    loader = torch.utils.data.DataLoader(ds, batch_size=8, shuffle=True, num_workers=2,
                                         multiprocessing_context=start)
    for epoch in range(2):
        before = ds.cache.stats()
        seen = []
        for images, labels in loader:
            for image, label in zip(images, labels):
                # which index: the first pixel of the flipped image is the base's last of row 0
                i = next(k for k in range(N) if torch.equal(base[k][0].flip(-1), image))
                assert int(label) == i % 5
                seen.append(i)
        assert sorted(seen) == list(range(N))
        after = ds.cache.stats()
        assert after["hits"] - before["hits"] == (0 if epoch == 0 else N)
    ds.close()
    assert named(shm_dir) == []


def test_items_of_arrays_and_numbers_become_fields_and_come_back_as_tensors(shm_dir):
    ds = CachedDataset(LibraryDataset(as_numpy=True), size_limit_gib=1)
    assert ds.cache.data_dims == {"image": (3, 8, 8), "label": (), "weight": ()}
    first, again = ds[3], ds[3]
    assert ds.cache.stats()["hits"] == 1
    assert torch.equal(first["image"], torch.from_numpy(LibraryDataset(as_numpy=True)[3]["image"]))
    assert first["label"].dtype == torch.int64 and int(again["label"]) == 3
    assert float(again["weight"]) == 0.5
    ds.close()


@pytest.mark.parametrize("own_cache", [False, True])
def test_tuple_items_are_kept_as_fields_item0_item1_and_come_back_as_tuples(shm_dir, own_cache):
    """As CachedDataset's docstring and docs/sources.md say: a tuple is kept as fields item0,
    item1, ... (ds.cache.fields), read back as a tuple, and loaded (ds.load, get_slot) as the
    dict of them; a cache of one's own with those fields takes the tuples."""
    base = LibraryDataset()
    cache = SharedCache(1, N, {"item0": (3, 8, 8), "item1": ()},
                        {"item0": torch.uint8, "item1": torch.int64}) if own_cache else None
    ds = CachedDataset(base, cache, **({} if own_cache else {"size_limit_gib": 1}))
    assert ds.cache.fields == ("item0", "item1")
    for got in (ds[3], ds[3]):  # a miss, then a hit
        assert type(got) is tuple and len(got) == 2
        assert torch.equal(got[0], base[3][0]) and int(got[1]) == 3
    assert ds.cache.stats()["hits"] == 1
    for i, kept in ((4, ds.load(4)), (3, ds.cache.get_slot(3))):
        assert sorted(kept) == ["item0", "item1"]
        assert torch.equal(kept["item0"], base[i][0]) and int(kept["item1"]) == i % 5
    ds.close()


def test_decode_before_and_transform_after_the_cache(shm_dir):
    calls = []

    def decode(item):
        calls.append(1)
        image, label = item
        return image.float().mean(0, keepdim=True).round().to(torch.uint8)  # (1, 8, 8)

    ds = CachedDataset(LibraryDataset(), decode=decode, transform=lambda x: x.flip(-1),
                       size_limit_gib=1, verify_loads=0)
    assert ds.cache.data_dims == (1, 8, 8)
    want = decode(LibraryDataset()[7]).flip(-1)
    calls.clear()
    assert torch.equal(ds[7], want) and torch.equal(ds[7], want)
    assert len(calls) == 1  # decoded once: the second read was a hit
    ds.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_random_transform_inside_the_base_is_caught_naming_the_split_point(shm_dir, workers):
    ds = CachedDataset(LibraryDataset(random=True), size_limit_gib=1)
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=workers)
    with pytest.raises(RuntimeError, match=r"CachedDataset: two loads in one process of index "
                                           r"0 gave different values, so the part before the "
                                           r"cache \(base\[i\]\) is not deterministic.*pass it "
                                           r"as transform="):
        next(iter(loader))
    assert ds.cache.stats()["filled"] == 0  # nothing random was cached
    ds.close()


class SlowRandomDataset(LibraryDataset):
    """Random inside, and slow: two workers that load one index at once both miss."""

    def __getitem__(self, i: int):
        time.sleep(0.5)
        return torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8), i % 5


@pytest.mark.timeout(60)
def test_two_processes_storing_different_values_are_told_the_split_point(shm_dir):
    # With verification off, the cache's own check (set_slot refuses a different value) is
    # what catches it, when two workers load index 5 at once; the wrapper says why.
    ds = CachedDataset(SlowRandomDataset(), size_limit_gib=1, verify_loads=0)
    loader = torch.utils.data.DataLoader(ds, batch_size=1, sampler=[5, 5], num_workers=2)
    with pytest.raises(RuntimeError, match=r"two processes' loads of index 5 gave different "
                                           r"values, so the part before the cache"):
        list(loader)
    ds.close()


def test_open_sizes_with_a_cache_of_ones_own(shm_dir):
    class Ragged(LibraryDataset):
        def __getitem__(self, i):
            return torch.full((3, 4 + i % 3, 5), i, dtype=torch.uint8)

    cache = OpenSizeCache(0.01, N, (3, None, 5), name="ragged")
    ds = CachedDataset(Ragged(), cache)
    for i in range(N):
        assert torch.equal(ds[i], Ragged()[i])
    assert all(torch.equal(ds[i], Ragged()[i]) for i in range(N))
    assert cache.stats()["hits"] == N
    ds.close()


def test_samplers_and_loaders_of_stocaching_work_over_it(shm_dir):
    ds = CachedDataset(LibraryDataset(), size_limit_gib=1)
    sampler = CacheAwareSampler(ds, num_replicas=1, rank=0, batch_size=8, seed=0)
    assert sorted(sampler) == list(range(N))
    prefetcher = Prefetcher(torch.utils.data.RandomSampler(ds), ds.cache, ds.load, threads=2)
    loader = torch.utils.data.DataLoader(ds, batch_size=8, sampler=prefetcher)
    assert sum(len(b[0]) for b in loader) == N and ds.cache.stats()["filled"] == N
    ds.cache.clear()
    with DeviceLoader(ds.cache, torch.utils.data.SequentialSampler(ds), ds.load, batch_size=8,
                      device="cpu") as device_loader:
        got = [(indices, batch) for batch, indices in device_loader]
    for indices, batch in got:
        for k, i in enumerate(indices.tolist()):
            assert torch.equal(batch["item0"][k], LibraryDataset()[i][0])
    ds.close()


@pytest.mark.parametrize("kw,error,match", [
    (dict(base=[1, 2, 3][0]), TypeError, r"base should be a map-style dataset"),
    (dict(decode="resize"), TypeError, r"decode should be a function of one item or None, "
                                       r"but got decode='resize'"),
    (dict(cache=SharedCache), TypeError, r"cache should be a SharedCache or OpenSizeCache"),
    (dict(verify_loads=-1), ValueError, r"verify_loads"),
    (dict(base=LibraryDataset(n=0)), ValueError, r"at least one item, but got len\(base\)=0"),
    (dict(decode=lambda item: "a path"), TypeError, r"decode\(base\[i\]\) should be made of "
                                                    r"tensors.*but got str"),
])
def test_bad_arguments_are_refused_before_a_cache_is_made(shm_dir, kw, error, match):
    args = dict(base=LibraryDataset(), size_limit_gib=1)
    args.update(kw)
    with pytest.raises(error, match=match):
        CachedDataset(**args)
    assert named(shm_dir) == []


class Items(torch.utils.data.Dataset):
    """Items given as a list: whatever a dataset may return."""

    def __init__(self, items) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


@pytest.mark.parametrize("items,error,match", [
    ([(torch.zeros(2), (1, 2))], TypeError, r"base\[i\]\[1\] should be made of tensors.*not "
                                            r"nested.*but got tuple"),
    ([{"a": {"b": torch.zeros(2)}}], TypeError, r"not nested"),
    ([{"pixel-values": torch.zeros(2)}], TypeError, r"keys that are Python identifiers.*"
                                                    r"'pixel-values'"),
    ([1.0, 2.0], TypeError, r"a single number \(1.0\): return it as a tensor of shape "
                            r"\(1,\)"),
])
def test_values_the_cache_cannot_hold_are_named_as_the_items(shm_dir, items, error, match):
    with pytest.raises(error, match=match):
        CachedDataset(Items(items), size_limit_gib=1)
    assert named(shm_dir) == []


def test_an_item_of_another_size_says_the_first_item_sized_the_cache(shm_dir):
    ds = CachedDataset(Items([torch.zeros(3, 4, 4, dtype=torch.uint8),
                              torch.zeros(3, 5, 4, dtype=torch.uint8)]), size_limit_gib=1)
    with pytest.raises(ValueError, match=r"index 1: base\[i\] gave a value the cache cannot "
                                         r"hold \(.*\)\. The cache was made for the shapes "
                                         r"and dtypes of index 0.*OpenSizeCache"):
        ds[1]
    assert torch.equal(ds[-2], torch.zeros(3, 4, 4, dtype=torch.uint8))  # (as base[-2])
    ds.close()


def test_other_arguments_and_streams_are_named_as_the_wrappers(shm_dir):
    with pytest.raises(TypeError, match=r"CachedDataset got an unexpected keyword argument "
                                        r"'shuffle'"):
        CachedDataset(LibraryDataset(), shuffle=True)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield torch.zeros(2)

    with pytest.raises(TypeError, match=r"got an IterableDataset \(Stream\): for a stream of "
                                        r"shards, see CachedStream"):
        CachedDataset(Stream())
    assert named(shm_dir) == []


def test_a_cache_of_another_length_or_with_options_is_refused(shm_dir):
    with SharedCache(1, N + 1, (3, 8, 8)) as cache:
        with pytest.raises(ValueError, match=rf"dataset_len=len\(base\)={N}, but got a cache "
                                             rf"with dataset_len={N + 1}"):
            CachedDataset(LibraryDataset(), cache)
        with pytest.raises(TypeError, match=r"cache options \(name\) are for the cache that "
                                            r"CachedDataset makes"):
            CachedDataset(LibraryDataset(), cache, name="x")


# -- Hugging Face datasets ----------------------------------------------------------------------

def make_pngs(root: str, n: int = 24) -> None:
    """n PNGs of several sizes in two class folders; image k's first channel is k + 1
    throughout (it names the image), its second a left-to-right ramp (a flip shows)."""
    from PIL import Image
    for k in range(n):
        h, w = 20 + k % 4 * 3, 24 + k % 3 * 5
        a = np.zeros((h, w, 3), np.uint8)
        a[..., 0] = k + 1
        a[..., 1] = np.linspace(0, 250, w, dtype=np.uint8)[None, :]
        a[..., 2] = 7 * k % 256
        os.makedirs(os.path.join(root, f"class{k % 2}"), exist_ok=True)
        Image.fromarray(a).save(os.path.join(root, f"class{k % 2}", f"{k:03d}.png"))


def hf_imagefolder(root: str):
    """A Hugging Face dataset of the PNGs in ``root``, as its docs make one, with torch
    tensors for items (no network: a packaged builder)."""
    datasets = pytest.importorskip("datasets")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    return datasets.load_dataset("imagefolder", data_dir=root, split="train",
                                 cache_dir=os.path.join(root, ".hf")).with_format("torch")


def resized(image: torch.Tensor) -> torch.Tensor:
    """The deterministic part: an image of any size to uint8 (3, SIZE, SIZE)."""
    x = torch.nn.functional.interpolate(image[None].float(), size=(SIZE, SIZE), mode="nearest")
    return x[0].to(torch.uint8)


def random_flip(value):
    """The random part, after the cache."""
    if torch.rand(()) < 0.5:
        value = dict(value, image=value["image"].flip(-1))
    return value


def decode_hf(item):
    return {"image": resized(item["image"]), "label": item["label"]}


def test_a_hugging_face_dataset_through_dataloader_workers(shm_dir, tmp_path):
    make_pngs(str(tmp_path))
    base = hf_imagefolder(str(tmp_path))
    ds = CachedDataset(base, decode=decode_hf, transform=random_flip)
    assert ds.cache.data_dims == {"image": (3, SIZE, SIZE), "label": ()}
    wanted = {int(resized(base[i]["image"])[0, 0, 0]): resized(base[i]["image"])
              for i in range(len(base))}
    loader = torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True, num_workers=2)
    flipped = 0
    for epoch in range(2):
        before, seen = ds.cache.stats()["hits"], []
        for batch in loader:
            for image, label in zip(batch["image"], batch["label"]):
                want = wanted[int(image[0, 0, 0])]
                assert torch.equal(image, want) or torch.equal(image, want.flip(-1))
                flipped += not torch.equal(image, want)
                assert int(label) == (int(image[0, 0, 0]) - 1) % 2
                seen.append(int(image[0, 0, 0]))
        assert sorted(seen) == sorted(wanted)
        assert ds.cache.stats()["hits"] - before == (0 if epoch == 0 else len(base))
    assert 0 < flipped < 2 * len(base)  # the random part ran after the cache
    ds.close()
    assert named(shm_dir) == []


def test_set_transform_with_a_random_part_is_caught(shm_dir, tmp_path):
    make_pngs(str(tmp_path), n=8)
    base = hf_imagefolder(str(tmp_path))

    shifts = itertools.count(1)  # a new shift at every call: as a random crop, but two calls
    # never draw the same one (torch.randint(1, 9) did, 1 time in 8, and the test failed)

    def random_crop_inside(batch):  # the wrong place: HF's set_transform, before the cache
        return {"image": [torch.roll(torch.as_tensor(np.array(im)), next(shifts) % 8 + 1, 1)
                          for im in batch["image"]], "label": batch["label"]}

    base.set_transform(random_crop_inside)
    with pytest.raises(RuntimeError, match=r"not deterministic.*inside Dataset or decode"):
        CachedDataset(base, decode=lambda item: item["image"][:8, :8], size_limit_gib=1)[0]


@pytest.mark.timeout(300)
def test_a_hugging_face_dataset_under_torchrun(tmpfs, tmp_path):
    pytest.importorskip("datasets")
    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir()
    out.mkdir()
    make_pngs(str(data))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master-port={free_port()}", str(CHILDREN / "wrapped_ranks.py"), str(data),
           str(out)]
    r = subprocess.run(cmd, env=rank_env(tmpfs, HF_DATASETS_OFFLINE="1"), capture_output=True,
                       text=True, timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = [json.loads((out / f"rank{k}.json").read_text()) for k in range(2)]
    assert [rk["segments"] for rk in ranks] == [1, 1]  # one segment for the node
    for epoch in range(2):
        indices = sorted(i for rk in ranks for i in rk["epochs"][epoch]["indices"])
        assert indices == list(range(24))  # every index once an epoch over 2 ranks
        assert sum(rk["epochs"][epoch]["wrong"] for rk in ranks) == 0
    # stats() counts the node's processes: epoch 1 filled the cache, epoch 2 hit every index
    assert [[rk["epochs"][e]["hits"] for e in range(2)] for rk in ranks] == [[0, 24], [0, 24]]
    assert_no_leak(tmpfs)


@pytest.mark.timeout(120)
def test_a_resume_mid_epoch_is_exact(shm_dir):
    """The wrapper keeps no position of its own: torchdata's StatefulDataLoader resumes it
    through its sampler's state, as any map-style dataset."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    ds = CachedDataset(LibraryDataset(), size_limit_gib=1)

    def loader():
        return stateful.StatefulDataLoader(
            ds, batch_size=4, num_workers=2,
            sampler=torch.utils.data.RandomSampler(ds, generator=torch.Generator().manual_seed(5)))

    def labels_and_firsts(batch):
        images, labels = batch
        return [(int(x[0, 0, 0]), int(y)) for x, y in zip(images, labels)]

    whole = [s for b in loader() for s in labels_and_firsts(b)]
    first, before = loader(), []
    it = iter(first)
    for _ in range(3):
        before += labels_and_firsts(next(it))
    state = first.state_dict()
    del it, first
    again = loader()
    again.load_state_dict(state)
    after = [s for b in again for s in labels_and_firsts(b)]
    assert before + after == whole and len(whole) == N
    ds.close()


def test_the_wrapper_works_copied_next_to_stocaching_py(shm_dir, tmp_path):
    """wrapper.py copied beside stocaching.py and _common.py (and fields.py: tuple items make
    a cache of fields): the copies import each other, not the package."""
    out = run_copied(tmp_path, ("stocaching.py", "_common.py", "fields.py", "wrapper.py"), """
        import os, _common, stocaching, torch, wrapper
        assert os.path.dirname(stocaching.__file__) == os.getcwd()  # the copy, not the package
        assert wrapper.SharedCache is stocaching.SharedCache
        assert wrapper._as_tensors is _common._as_tensors
        with wrapper.CachedDataset([(torch.full((2,), i), i) for i in range(4)],
                                   size_limit_gib=0.001) as ds:
            print([(x.tolist(), y.item()) for x, y in (ds[i] for i in range(4))])
    """)
    assert out.strip() == "[([0, 0], 0), ([1, 1], 1), ([2, 2], 2), ([3, 3], 3)]"
