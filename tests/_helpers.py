"""Objects that DataLoader workers started with spawn or forkserver must be able to import."""

from __future__ import annotations

import torch

from stocaching import SharedCache


def value_of(i: int, dims=(3, 8, 8)) -> torch.Tensor:
    """A deterministic sample for index i, so any process can check what it reads."""
    return torch.full(dims, i % 251, dtype=torch.uint8)


class CachedDataset(torch.utils.data.Dataset):
    """The two-line pattern of the README, with a 'decode' that records misses."""

    def __init__(self, cache: SharedCache, n: int):
        self.cache, self.n = cache, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x = self.cache.get_slot(i)
        hit = x is not None
        if x is None:
            x = value_of(i)
            self.cache.set_slot(i, x)
        return i, x, hit
