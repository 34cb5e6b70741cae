"""Multi-scale RoIAlign over FPN levels, torchvision's `MultiScaleRoIAlign` semantics.

torchvision selects each level's RoIs with `torch.where`, a host sync per level. Here the RoIs
are ordered by level once; a single read of the per-level counts (one sync for the whole call,
none when there is one level) sizes the contiguous chunks. Each level is one RoIAlign call, and
one scatter puts the pooled features back in the RoIs' order.

In training mode on CUDA the call does not synchronize at all: every level's RoIAlign gets all
RoIs, those of other levels moved far outside the map, where their bins are exact zeros (the
band kernels do not visit a bin row with no sample on the map, and it gets no gradient), and
the levels' outputs are summed. That reads and writes K pooled outputs per
level instead of one scatter, and keeps a training step free of host syncs.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from ._utils import as_int, boxes_to_rois, pair
from .roi_align import roi_align

__all__ = ["LevelMapper", "MultiScaleRoIAlign", "infer_scale"]


class LevelMapper:
    """FPN level of each box, eq. (1) of the FPN paper:
    k = floor(k0 + log2(sqrt(w * h) / s0) + eps), clamped to [k_min, k_max].

    Args:
        k_min (int): finest level (e.g. 2 for a stride-4 map).
        k_max (int): coarsest level.
        canonical_scale (int): s0, the box size mapped to level k0 (224).
        canonical_level (int): k0 (4).
        eps (float): tolerance against rounding at level boundaries.
    """

    def __init__(self, k_min: int, k_max: int, canonical_scale: int = 224, canonical_level: int = 4, eps: float = 1e-6):
        if k_min > k_max:
            raise ValueError(f"detops.LevelMapper: k_min ({k_min}) must not exceed k_max ({k_max})")
        self.k_min = k_min
        self.k_max = k_max
        self.s0 = canonical_scale
        self.lvl0 = canonical_level
        self.eps = eps

    def __call__(self, boxlists: List[Tensor]) -> Tensor:
        """Level index (0 for k_min) of every box of every image, int64 [sum L_i]; -1 for a box
        with no level: one whose area is negative or NaN (x2 < x1 in one axis, a NaN
        coordinate)."""
        boxes = torch.cat(boxlists, 0)
        area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
        s = torch.sqrt(area)
        target = torch.floor(self.lvl0 + torch.log2(s / self.s0) + torch.tensor(self.eps, dtype=s.dtype))
        target = torch.clamp(target, min=self.k_min, max=self.k_max)
        # NaN has no integer value (its conversion is undefined): such boxes get -1
        target = torch.nan_to_num(target, nan=self.k_min - 1)
        return (target.to(torch.int64) - self.k_min).to(torch.int64)


def infer_scale(feature: Tensor, original_size: Sequence[int]) -> float:
    """The power of two closest to feature height / image height (e.g. 0.25 for stride 4)."""
    approx = float(feature.shape[-2]) / float(original_size[0])
    return 2.0 ** round(math.log2(approx))


class MultiScaleRoIAlign(nn.Module):
    """RoIAlign over a set of FPN feature maps, each box pooled from the level that fits its size.

    Args:
        featmap_names (list[str]): names of the feature maps to pool from, finest first.
        output_size (int or (int, int)): pooled height and width.
        sampling_ratio (int): samples per bin along each axis (<= 0: adaptive).
        canonical_scale (int): box size that maps to `canonical_level` (224).
        canonical_level (int): FPN level of a canonical box (4).

    forward(x, boxes, image_shapes):
        x (dict[str, Tensor[B, C, H_l, W_l]]): feature maps.
        boxes (list[Tensor[L_i, 4]]): boxes of each image, x1, y1, x2, y2 in image coordinates.
        image_shapes (list[(int, int)]): (height, width) of each image before batching.
        Returns Tensor[sum L_i, C, out_h, out_w], in the order of the boxes. With several
        levels, a box whose area is negative or NaN has no level and pools to zeros (as in
        torchvision); with one level every box is pooled from it.

    In training mode (``module.train()``) on CUDA the forward makes no host sync (see the
    module docstring); the values are the same.
    """

    def __init__(
        self,
        featmap_names: List[str],
        output_size: Union[int, Tuple[int, int], List[int]],
        sampling_ratio: int,
        *,
        canonical_scale: int = 224,
        canonical_level: int = 4,
    ):
        super().__init__()
        if isinstance(featmap_names, str) or not featmap_names:
            raise ValueError("detops.MultiScaleRoIAlign: featmap_names must be a non-empty list of names")
        self.featmap_names = list(featmap_names)
        self.output_size = pair(output_size, "detops.MultiScaleRoIAlign")
        self.sampling_ratio = as_int(sampling_ratio, "detops.MultiScaleRoIAlign", "sampling_ratio")
        self.canonical_scale = canonical_scale
        self.canonical_level = canonical_level
        self.scales: Optional[List[float]] = None
        self.map_levels: Optional[LevelMapper] = None

    def setup_scales(self, features: List[Tensor], image_shapes: List[Tuple[int, int]]) -> None:
        """Scales of the feature maps and the level mapper, from the largest image size."""
        if not image_shapes:
            raise ValueError("detops.MultiScaleRoIAlign: image_shapes must list the size of every image")
        original = (max(s[0] for s in image_shapes), max(s[1] for s in image_shapes))
        scales = [infer_scale(f, original) for f in features]
        self.scales = scales
        lvl_min = -math.log2(scales[0])
        lvl_max = -math.log2(scales[-1])
        if int(lvl_max) - int(lvl_min) + 1 != len(features):
            raise ValueError(
                f"detops.MultiScaleRoIAlign: the feature maps must be consecutive FPN levels, finest first; "
                f"their scales are {scales}"
            )
        self.map_levels = LevelMapper(
            int(lvl_min), int(lvl_max), canonical_scale=self.canonical_scale, canonical_level=self.canonical_level
        )

    def forward(self, x: Dict[str, Tensor], boxes: List[Tensor], image_shapes: List[Tuple[int, int]]) -> Tensor:
        missing = [k for k in self.featmap_names if k not in x]
        if missing:
            raise KeyError(f"detops.MultiScaleRoIAlign: feature maps {missing} not in the input (have {list(x)})")
        features = [x[k] for k in self.featmap_names]
        if not isinstance(boxes, (list, tuple)):
            raise TypeError(
                f"detops.MultiScaleRoIAlign: boxes must be a list of Tensor[L, 4], one per image, got {type(boxes).__name__}"
            )
        for i, b in enumerate(boxes):
            if isinstance(b, Tensor) and b.device != features[0].device:
                raise ValueError(
                    f"detops.MultiScaleRoIAlign: boxes[{i}] must be on the device of the feature maps, "
                    f"got {b.device} and {features[0].device}"
                )
            if isinstance(b, Tensor) and not b.is_floating_point():
                raise ValueError(f"detops.MultiScaleRoIAlign: boxes[{i}] must be a float tensor, got {b.dtype}")
        self.setup_scales(features, image_shapes)
        assert self.scales is not None and self.map_levels is not None
        rois = boxes_to_rois(boxes, "detops.MultiScaleRoIAlign")
        out_h, out_w = self.output_size
        if len(features) == 1:
            return roi_align(features[0], rois, self.output_size, self.scales[0], self.sampling_ratio)

        levels = self.map_levels(boxes)
        if self.training and rois.is_cuda:
            return self._forward_without_sync(features, rois, levels)
        num_levels = len(features)
        order = torch.argsort(levels, stable=True)
        # boxes without a level (-1) come first and pool to zeros
        counts = torch.bincount(levels + 1, minlength=num_levels + 1).tolist()  # the one host sync
        sorted_rois = rois.index_select(0, order)
        chunks = sorted_rois.split(counts)
        # the boxes without a level pooled far off the finest map: exact zeros, from the op
        # itself (which checks the arguments as for any chunk)
        far = -8.0 / min(self.scales) - 8.0
        nowhere = torch.cat([chunks[0][:, :1], torch.full_like(chunks[0][:, 1:], far)], 1)
        pooled = [roi_align(features[0], nowhere, self.output_size, self.scales[0], self.sampling_ratio)]
        for feature, scale, chunk in zip(features, self.scales, chunks[1:]):
            pooled.append(roi_align(feature, chunk, self.output_size, scale, self.sampling_ratio))
        stacked = torch.cat(pooled, 0)
        result = torch.empty(
            (rois.size(0), features[0].size(1), out_h, out_w), dtype=stacked.dtype, device=stacked.device
        )
        return result.index_copy(0, order, stacked)

    def _forward_without_sync(self, features: List[Tensor], rois: Tensor, levels: Tensor) -> Tensor:
        """Each level pools every RoI; the others' boxes are moved to `far`, where all samples
        lie off the map (below -1 at the coarsest scale), so they pool to exact zeros."""
        assert self.scales is not None
        far = -8.0 / min(self.scales) - 8.0
        # the RoIs of every level at once: [L, K, 5], other levels' boxes moved off the map
        lvl = torch.arange(len(features), device=rois.device, dtype=levels.dtype)
        box = torch.where((levels[None, :] == lvl[:, None])[..., None], rois[None, :, 1:], far)
        per_level = torch.cat([rois[None, :, :1].expand(len(features), -1, -1), box], 2)
        out: Optional[Tensor] = None
        for feature, scale, level_rois in zip(features, self.scales, per_level):
            pooled = roi_align(feature, level_rois, self.output_size, scale, self.sampling_ratio)
            out = pooled if out is None else out + pooled
        assert out is not None
        return out

    def extra_repr(self) -> str:
        return (
            f"featmap_names={self.featmap_names}, output_size={self.output_size}, "
            f"sampling_ratio={self.sampling_ratio}, canonical_scale={self.canonical_scale}, "
            f"canonical_level={self.canonical_level}"
        )
