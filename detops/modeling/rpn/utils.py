"""Flattening of per-level RPN outputs into one row per anchor, in the anchors' order."""
from __future__ import annotations

from typing import List, Tuple

import torch
from torch import Tensor


def permute_and_flatten(layer: Tensor, n: int, a: int, c: int, h: int, w: int) -> Tensor:
    """[N, A*C, H, W] -> [N, H*W*A, C] (location-major, then anchor)."""
    return layer.view(n, a, c, h, w).permute(0, 3, 4, 1, 2).reshape(n, -1, c)


def concat_box_prediction_layers(box_cls: List[Tensor], box_regression: List[Tensor]) -> Tuple[Tensor, Tensor]:
    """Per-level objectness [N, A, H, W] and deltas [N, 4A, H, W] -> [N * sum(HWA), 1] and
    [N * sum(HWA), 4], image-major, levels concatenated within each image."""
    flat_cls, flat_reg = [], []
    for cls, reg in zip(box_cls, box_regression):
        n, ac, h, w = cls.shape
        a = reg.shape[1] // 4
        c = ac // a
        flat_cls.append(permute_and_flatten(cls, n, a, c, h, w))
        flat_reg.append(permute_and_flatten(reg, n, a, 4, h, w))
    return torch.cat(flat_cls, dim=1).flatten(0, -2), torch.cat(flat_reg, dim=1).reshape(-1, 4)
