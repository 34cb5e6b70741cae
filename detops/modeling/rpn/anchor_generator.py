"""Anchors: for each feature level, one box per (location, size, aspect ratio)."""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch import Tensor, nn


def generate_cell_anchors(sizes: Sequence[float], aspect_ratios: Sequence[float],
                          dtype=torch.float32, device=None) -> Tensor:
    """Anchors centred on (0, 0): [len(aspect_ratios) * len(sizes), 4], ratio-major, rounded
    to integers. An anchor of size s and ratio r = h / w has w = s / sqrt(r), h = s * sqrt(r)."""
    scales = torch.as_tensor(sizes, dtype=dtype, device=device)
    ratios = torch.as_tensor(aspect_ratios, dtype=dtype, device=device)
    h_ratios = torch.sqrt(ratios)
    w_ratios = 1 / h_ratios
    ws = (w_ratios[:, None] * scales[None, :]).view(-1)
    hs = (h_ratios[:, None] * scales[None, :]).view(-1)
    return (torch.stack([-ws, -hs, ws, hs], dim=1) / 2).round()


class AnchorGenerator(nn.Module):
    """Anchors of every FPN level, concatenated level after level.

    Args:
        sizes (list[list[float]]): anchor sizes of each level.
        aspect_ratios (list[list[float]]): aspect ratios (h / w) of each level.
        strides (list[int] or None): stride of each level in input pixels; None infers it from
            the padded batch size and the feature size (batch_size // feature_size, as
            torchvision does; this is what its weights were trained with).

    forward(image_list, feature_maps) -> list (one per image) of Tensor[sum_l H_l*W_l*A_l, 4];
    within a level, anchors are ordered location-major (row, column), then cell anchor. The
    tensors are cached per feature-map size and shared: treat them as read-only.
    """

    def __init__(self, sizes, aspect_ratios, strides: Optional[Sequence[int]] = None):
        super().__init__()
        if len(sizes) != len(aspect_ratios):
            raise ValueError(f"AnchorGenerator: {len(sizes)} levels of sizes but {len(aspect_ratios)} of aspect ratios")
        if strides is not None and len(strides) != len(sizes):
            raise ValueError(f"AnchorGenerator: {len(sizes)} levels of sizes but {len(strides)} strides")
        self.sizes = [tuple(s) for s in sizes]
        self.aspect_ratios = [tuple(a) for a in aspect_ratios]
        self.strides = None if strides is None else list(strides)
        self.cell_anchors = [generate_cell_anchors(s, a) for s, a in zip(self.sizes, self.aspect_ratios)]
        # anchors of each (grid sizes, strides, device) seen: a batch of the same size as the
        # last one needs no kernels and no host-to-device copy
        self._cache = {}

    def num_anchors_per_location(self) -> List[int]:
        return [len(s) * len(a) for s, a in zip(self.sizes, self.aspect_ratios)]

    def grid_anchors(self, grid_sizes, strides, device) -> List[Tensor]:
        out = []
        for (gh, gw), (sh, sw), base in zip(grid_sizes, strides, self.cell_anchors):
            base = base.to(device)
            shifts_x = torch.arange(0, gw, dtype=torch.int32, device=device) * sw
            shifts_y = torch.arange(0, gh, dtype=torch.int32, device=device) * sh
            sy, sx = torch.meshgrid(shifts_y, shifts_x, indexing="ij")
            sx, sy = sx.reshape(-1), sy.reshape(-1)
            shifts = torch.stack((sx, sy, sx, sy), dim=1)
            out.append((shifts.view(-1, 1, 4) + base.view(1, -1, 4)).reshape(-1, 4))
        return out

    def forward(self, image_list, feature_maps: List[Tensor]) -> List[Tensor]:
        if len(feature_maps) != len(self.cell_anchors):
            raise ValueError(
                f"AnchorGenerator: {len(feature_maps)} feature maps but anchors for {len(self.cell_anchors)} levels "
                f"(MODEL.RPN.ANCHOR_SIZES)"
            )
        grid_sizes = [tuple(f.shape[-2:]) for f in feature_maps]
        image_size = image_list.tensors.shape[-2:]
        if self.strides is None:
            strides = [(image_size[0] // g[0], image_size[1] // g[1]) for g in grid_sizes]
        else:
            strides = [(s, s) for s in self.strides]
        device = feature_maps[0].device
        key = (tuple(grid_sizes), tuple(strides), str(device))
        anchors = self._cache.get(key)
        if anchors is None:
            anchors = torch.cat(self.grid_anchors(grid_sizes, strides, device), dim=0)
            if len(self._cache) >= 16:
                self._cache.clear()
            self._cache[key] = anchors
        return [anchors for _ in range(len(image_list.image_sizes))]


def make_anchor_generator(cfg) -> AnchorGenerator:
    rpn = cfg.MODEL.RPN
    sizes = [(s,) for s in rpn.ANCHOR_SIZES]
    ratios = [tuple(rpn.ASPECT_RATIOS)] * len(sizes)
    strides = None if rpn.INFER_ANCHOR_STRIDE else rpn.ANCHOR_STRIDE
    return AnchorGenerator(sizes, ratios, strides)
