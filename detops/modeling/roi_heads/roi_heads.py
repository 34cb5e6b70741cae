"""RoI heads: the box head, then (with MODEL.MASK_ON) the mask head on its output."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from torch import Tensor, nn

from ...structures import BoxList
from ..utils import PaddedTargets
from .box_head.box_head import build_roi_box_head
from .mask_head.mask_head import build_roi_mask_head


class CombinedROIHeads(nn.Module):
    """forward(features, proposals, image_sizes, targets, padded_targets=None) -> (detections, losses).
    `padded_targets` (`detops.modeling.utils.pad_targets` of the targets) goes to the box head's
    sampling."""

    def __init__(self, heads: Dict[str, nn.Module]):
        super().__init__()
        for name, head in heads.items():
            self.add_module(name, head)

    def forward(self, features: Dict[str, Tensor], proposals: List[BoxList], image_sizes: List[Tuple[int, int]],
                targets: Optional[List[BoxList]] = None,
                padded_targets: Optional[PaddedTargets] = None) -> Tuple[List[BoxList], Dict[str, Tensor]]:
        losses = {}
        _, detections, box_losses = self.box(features, proposals, image_sizes, targets, padded_targets)
        losses.update(box_losses)
        if hasattr(self, "mask"):
            _, detections, mask_losses = self.mask(features, detections, image_sizes, targets)
            losses.update(mask_losses)
        return detections, losses


def build_roi_heads(cfg, in_channels: int) -> Optional[CombinedROIHeads]:
    """None for an RPN-only model."""
    if cfg.MODEL.RPN_ONLY:
        return None
    heads = {"box": build_roi_box_head(cfg, in_channels)}
    if cfg.MODEL.MASK_ON:
        heads["mask"] = build_roi_mask_head(cfg, in_channels)
    return CombinedROIHeads(heads)
