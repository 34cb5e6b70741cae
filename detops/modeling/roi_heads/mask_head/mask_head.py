"""The mask head: FCN on 14x14 RoI features of positive RoIs (training) or detections (eval)."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from ....structures import BoxList
from ...registry import ROI_MASK_FEATURE_EXTRACTORS, ROI_MASK_PREDICTOR
from . import roi_mask_feature_extractors, roi_mask_predictors  # noqa: F401  (registration)
from .inference import mask_probabilities
from .loss import mask_rcnn_loss


def keep_only_positive_boxes(boxes: List[BoxList]) -> List[BoxList]:
    return [b[torch.where(b.get_field("labels") > 0)[0]] for b in boxes]


def positive_slots(boxes: List[BoxList]) -> List[BoxList]:
    """The positives of each image's sampled RoIs from the box head's fixed-shape sampling,
    which puts them first: slices of known length once the counts (`positive_counts`,
    copied to the host while the GPU still runs earlier work) arrive."""
    return [b[:n] for b, n in zip(boxes, boxes[0].positive_counts.get())]


class ROIMaskHead(nn.Module):
    """forward(features, proposals, image_sizes, targets) -> (features, detections, losses).
    In eval the detections get a "mask" field [n, 1, M, M] of probabilities. In training the
    proposals are the box head's sampled RoIs, and the head runs on their positives."""

    def __init__(self, cfg, in_channels: int):
        super().__init__()
        head = cfg.MODEL.ROI_MASK_HEAD
        self.feature_extractor = ROI_MASK_FEATURE_EXTRACTORS[head.FEATURE_EXTRACTOR](cfg, in_channels)
        self.predictor = ROI_MASK_PREDICTOR[head.PREDICTOR](cfg, self.feature_extractor.out_channels)

    def forward(self, features: Dict[str, Tensor], proposals: List[BoxList], image_sizes: List[Tuple[int, int]],
                targets: Optional[List[BoxList]] = None):
        if self.training:
            if proposals and hasattr(proposals[0], "positive_counts"):
                proposals = positive_slots(proposals)
            else:
                proposals = keep_only_positive_boxes(proposals)
        x = self.feature_extractor(features, [p.bbox for p in proposals], image_sizes)
        mask_logits = self.predictor(x)
        if not self.training:
            mask_probabilities(mask_logits, proposals)
            return x, proposals, {}
        return x, proposals, {"loss_mask": mask_rcnn_loss(mask_logits, proposals, targets)}


def build_roi_mask_head(cfg, in_channels: int) -> ROIMaskHead:
    return ROIMaskHead(cfg, in_channels)
