"""The region proposal network: anchors + head + post-processing (+ losses in training)."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from torch import Tensor, nn

from ...structures import BoxList, ImageList
from ..balanced_positive_negative_sampler import BalancedPositiveNegativeSampler
from ..box_coder import BoxCoder
from ..matcher import Matcher
from ..registry import RPN_HEADS
from .anchor_generator import make_anchor_generator
from .inference import make_rpn_postprocessor
from .loss import RPNLossComputation
from . import rpn_head  # noqa: F401  (registers the heads)
from .utils import concat_box_prediction_layers


class RPNModule(nn.Module):
    """forward(images, features, targets) -> (proposals: list[BoxList], losses: dict)."""

    def __init__(self, cfg, in_channels: int):
        super().__init__()
        self.anchor_generator = make_anchor_generator(cfg)
        num_anchors = self.anchor_generator.num_anchors_per_location()
        if len(set(num_anchors)) != 1:
            raise ValueError("RPN: every level must have the same number of anchors per location")
        self.head = RPN_HEADS[cfg.MODEL.RPN.NAME](in_channels, num_anchors[0])
        box_coder = BoxCoder(cfg.MODEL.RPN.BBOX_REG_WEIGHTS)
        self.box_selector = make_rpn_postprocessor(cfg, box_coder)
        rpn = cfg.MODEL.RPN
        self.loss_evaluator = RPNLossComputation(
            Matcher(rpn.FG_IOU_THRESHOLD, rpn.BG_IOU_THRESHOLD, allow_low_quality_matches=True),
            BalancedPositiveNegativeSampler(rpn.BATCH_SIZE_PER_IMAGE, rpn.POSITIVE_FRACTION),
            box_coder,
        )

    def forward(self, images: ImageList, features: Dict[str, Tensor],
                targets: Optional[List[BoxList]] = None) -> Tuple[List[BoxList], Dict[str, Tensor]]:
        feats = list(features.values())
        objectness, deltas = self.head(feats)
        anchors = self.anchor_generator(images, feats)
        num_anchors_per_level = [o[0].numel() for o in objectness]
        objectness, deltas = concat_box_prediction_layers(objectness, deltas)
        proposals = self.box_selector(anchors, objectness, deltas, num_anchors_per_level, images.image_sizes)
        losses = {}
        if self.training:
            if targets is None:
                raise ValueError("RPN: targets are needed in training mode")
            obj_loss, box_loss = self.loss_evaluator(anchors, objectness, deltas, targets)
            losses = {"loss_objectness": obj_loss, "loss_rpn_box_reg": box_loss}
        return proposals, losses


def build_rpn(cfg, in_channels: int) -> RPNModule:
    return RPNModule(cfg, in_channels)
