"""The box head: feature extractor + predictor, losses in training, detections in eval."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from torch import Tensor, nn

from ....structures import BoxList
from ...registry import ROI_BOX_FEATURE_EXTRACTORS, ROI_BOX_PREDICTOR
from ...utils import PaddedTargets
from . import roi_box_feature_extractors, roi_box_predictors  # noqa: F401  (registration)
from .inference import make_roi_box_post_processor
from .loss import make_roi_box_loss_evaluator


class ROIBoxHead(nn.Module):
    """forward(features, proposals, image_sizes, targets, padded_targets=None) -> (box features,
    proposals or detections, losses).

    In training the returned BoxLists are the sampled RoIs (with "labels", "matched_idxs");
    in eval they are the detections (with "scores", "labels").
    """

    def __init__(self, cfg, in_channels: int):
        super().__init__()
        head = cfg.MODEL.ROI_BOX_HEAD
        self.feature_extractor = ROI_BOX_FEATURE_EXTRACTORS[head.FEATURE_EXTRACTOR](cfg, in_channels)
        self.predictor = ROI_BOX_PREDICTOR[head.PREDICTOR](cfg, self.feature_extractor.out_channels)
        self.post_processor = make_roi_box_post_processor(cfg)
        self.loss_evaluator = make_roi_box_loss_evaluator(cfg)

    def forward(self, features: Dict[str, Tensor], proposals: List[BoxList], image_sizes: List[Tuple[int, int]],
                targets: Optional[List[BoxList]] = None, padded_targets: Optional[PaddedTargets] = None):
        if self.training:
            proposals = self.loss_evaluator.subsample(proposals, targets, padded_targets)
        x = self.feature_extractor(features, [p.bbox for p in proposals], image_sizes)
        class_logits, box_regression = self.predictor(x)
        if not self.training:
            return x, self.post_processor(class_logits, box_regression, proposals), {}
        cls_loss, box_loss = self.loss_evaluator(class_logits, box_regression, proposals)
        return x, proposals, {"loss_classifier": cls_loss, "loss_box_reg": box_loss}


def build_roi_box_head(cfg, in_channels: int) -> ROIBoxHead:
    return ROIBoxHead(cfg, in_channels)
