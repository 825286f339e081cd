"""A deliberately small CNN, so that on a CPU the data pipeline, not the model, sets the pace.

At 128 x 128 inputs one training step costs about 0.2 ms per sample on one core of the
reference machine, against about 1.5 ms to read, decode and resize one 512 x 512 JPEG: with
the whole dataset cached, the epoch shrinks to what augmentation, collation and this model cost.
"""

from __future__ import annotations

import torch
from torch import nn


class SmallCNN(nn.Module):
    """Patchify stem (4x4, stride 4), two strided 3x3 convs, global average pool, linear.

    Args:
        num_classes: outputs. Default: 10.
        width: channels of the stem; doubled at each of the next two convs. Default: 16.
    """

    def __init__(self, num_classes: int = 10, width: int = 16) -> None:
        super().__init__()
        w = width
        self.features = nn.Sequential(
            nn.Conv2d(3, w, 4, stride=4), nn.BatchNorm2d(w), nn.ReLU(inplace=True),
            nn.Conv2d(w, 2 * w, 3, stride=2, padding=1), nn.BatchNorm2d(2 * w),
            nn.ReLU(inplace=True),
            nn.Conv2d(2 * w, 4 * w, 3, stride=2, padding=1), nn.BatchNorm2d(4 * w),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.head = nn.Linear(4 * w, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))
