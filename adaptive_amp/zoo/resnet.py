"""A small ResNet (basic blocks, batch norm) written here, trained in channels_last.

The zoo's convolutional net: channels_last is how conv nets are trained on
tensor cores, and it hands the statistics path strided activations.
torchvision would pin its own torch, so the net is ours.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from .model import ZooModel, cross_entropy_loss, image_batches


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = None
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.shortcut is None else self.shortcut(x)))


class ResNet(nn.Module):
    """``widths[i]`` channels and ``blocks[i]`` basic blocks per stage; every stage after the first halves
    the resolution. A 3x3 stem (small images, as CIFAR ResNets have) and a linear classifier."""

    def __init__(self, widths: Sequence[int], blocks: Sequence[int], num_classes: int, in_channels: int = 3):
        super().__init__()
        if len(widths) != len(blocks) or not widths:
            raise ValueError(f"widths {list(widths)} and blocks {list(blocks)} must be non-empty and of equal length")
        self.stem = nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(widths[0])
        stages, cin = [], widths[0]
        for i, (w, n) in enumerate(zip(widths, blocks)):
            stages.append(nn.Sequential(*[BasicBlock(cin if j == 0 else w, w, 2 if i and j == 0 else 1)
                                          for j in range(n)]))
            cin = w
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.stem(pixel_values)))
        x = self.stages(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


#: "small" is ResNet-18's stages on 64-pixel images, "medium" ResNet-34's.
RESNET_SIZES = {
    "tiny": dict(widths=(8, 16), blocks=(1, 1), num_classes=10, side=16),
    "small": dict(widths=(64, 128, 256, 512), blocks=(2, 2, 2, 2), num_classes=100, side=64),
    "medium": dict(widths=(64, 128, 256, 512), blocks=(3, 4, 6, 3), num_classes=100, side=64),
}


def resnet(size: str = "tiny") -> ZooModel:
    if size not in RESNET_SIZES:
        raise ValueError(f"size {size!r} is not one of the resnet sizes: {', '.join(RESNET_SIZES)}")
    cfg = dict(RESNET_SIZES[size])
    side = cfg.pop("side")
    model = ResNet(**cfg).to(memory_format=torch.channels_last)
    batches = image_batches(cfg["num_classes"], 3, side, channels_last=True)
    return ZooModel("resnet", size, model, batches, ("pixel_values",), cross_entropy_loss, side)
