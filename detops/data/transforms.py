"""Data-side transforms of (image [3, H, W] float in [0, 1], target dict) pairs.

The detector's own input transform (detops.modeling.transform) resizes every image to
INPUT.MIN_SIZE_* / MAX_SIZE_* and normalises it with INPUT.PIXEL_MEAN / PIXEL_STD, so the data
side does neither: it only decodes and augments. Random choices come from a generator seeded by
the sample's `aug_seed` (derived from the run seed and the iteration), so a resumed run sees the
same augmentations as an uninterrupted one.
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch


class Compose:
    def __init__(self, transforms: List[Callable]):
        self.transforms = transforms

    def __call__(self, image, target, aug_seed: Optional[int] = None):
        g = None
        if aug_seed is not None:
            g = torch.Generator().manual_seed(int(aug_seed))
        for t in self.transforms:
            image, target = t(image, target, g)
        return image, target


class RandomHorizontalFlip:
    """Flip image, boxes and masks with probability `prob`."""

    def __init__(self, prob: float = 0.5):
        self.prob = prob

    def __call__(self, image, target, g: Optional[torch.Generator]):
        if self.prob <= 0 or torch.rand((), generator=g).item() >= self.prob:
            return image, target
        w = image.shape[-1]
        image = image.flip(-1)
        target = dict(target)
        b = target["boxes"]
        target["boxes"] = torch.stack((w - b[:, 2], b[:, 1], w - b[:, 0], b[:, 3]), dim=1)
        if "masks" in target:
            target["masks"] = target["masks"].flip(-1)
        return image, target


def build_transforms(cfg, is_train: bool) -> Compose:
    if is_train:
        return Compose([RandomHorizontalFlip(cfg.DATALOADER.HFLIP_PROB)])
    return Compose([])
