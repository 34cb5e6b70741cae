"""The region proposal network: anchors + head + post-processing (+ losses in training)."""
from __future__ import annotations

import functools
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from ...structures import BoxList, ImageList
from ..balanced_positive_negative_sampler import BalancedPositiveNegativeSampler
from ..box_coder import BoxCoder
from ..cuda_graph import GraphedFunction, run_eagerly
from ..matcher import Matcher
from ..registry import RPN_HEADS
from ..utils import PaddedTargets, host_tensor, pad_targets
from .anchor_generator import make_anchor_generator
from .inference import make_rpn_postprocessor
from .loss import RPNLossComputation
from . import rpn_head  # noqa: F401  (registers the heads)
from .utils import concat_box_prediction_layers


class RPNModule(nn.Module):
    """forward(images, features, targets, padded_targets=None) -> (proposals: list[BoxList],
    losses: dict).

    In training everything after the head that needs no gradient (decoding, the top-n
    selection, NMS and padding of the proposals; matching, sampling and encoding of the
    anchors' targets) is one function of tensors in fixed shapes, run through CUDA graphs on
    CUDA (`target_graphs`, MODEL.TARGETS_CUDA_GRAPHS). `padded_targets` (from
    `detops.modeling.utils.pad_targets`) saves padding the targets again when the caller has.
    """

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
        self.target_graphs = GraphedFunction(max_graphs=cfg.MODEL.TARGETS_CUDA_GRAPHS,
                                             after=cfg.MODEL.TARGETS_CUDA_GRAPH_AFTER)

    def forward(self, images: ImageList, features: Dict[str, Tensor], targets: Optional[List[BoxList]] = None,
                padded_targets: Optional[PaddedTargets] = None) -> Tuple[List[BoxList], Dict[str, Tensor]]:
        feats = list(features.values())
        objectness, deltas = self.head(feats)
        anchors = self.anchor_generator(images, feats)
        num_anchors_per_level = [o[0].numel() for o in objectness]
        objectness, deltas = concat_box_prediction_layers(objectness, deltas)
        if not self.training:
            return self.box_selector(anchors, objectness, deltas, num_anchors_per_level, images.image_sizes), {}
        if targets is None:
            raise ValueError("RPN: targets are needed in training mode")
        gt = padded_targets if padded_targets is not None else pad_targets(targets)
        sizes = host_tensor(images.image_sizes, torch.float32, deltas.device)  # exact: sizes below 2^24
        levels = tuple(num_anchors_per_level)
        sel, ev = self.box_selector, self.loss_evaluator
        key = (levels, sel.pre_nms_top_n(), sel.post_nms_top_n(), sel.nms_thresh, sel.min_size, sel.score_thresh,
               sel.box_coder.weights, ev.proposal_matcher.high_threshold, ev.proposal_matcher.low_threshold,
               ev.fg_bg_sampler.batch_size_per_image, ev.fg_bg_sampler.positive_fraction)
        runner = self.__dict__.get("target_graphs", run_eagerly)  # absent from models pickled before it existed
        out = runner(functools.partial(self._training_targets, levels), objectness.detach(), deltas.detach(), sizes,
                     gt.boxes.to(anchors[0].dtype), gt.valid, *anchors, key=key)
        proposals = self.box_selector.boxlists(*out[:3], images.image_sizes)
        obj_loss, box_loss = self.loss_evaluator.losses(objectness, deltas, *out[3:])
        return proposals, {"loss_objectness": obj_loss, "loss_rpn_box_reg": box_loss}

    def _training_targets(self, levels: Tuple[int, ...], objectness: Tensor, deltas: Tensor, sizes: Tensor,
                          gt_boxes: Tensor, gt_valid: Tensor, *anchors: Tensor) -> Tuple[Tensor, ...]:
        """The proposals (boxes, objectness, valid) and the anchors' targets (RPNLossComputation.targets)."""
        num_images = len(anchors)
        anchors = torch.stack(anchors)  # [B, A, 4]
        proposals = self.box_selector.box_coder.decode(deltas, anchors.flatten(0, 1)).view(num_images, -1, 4)
        boxes = self.box_selector.padded(proposals, objectness.reshape(num_images, -1), list(levels), sizes)
        return boxes + self.loss_evaluator.targets(anchors, gt_boxes, gt_valid)


def build_rpn(cfg, in_channels: int) -> RPNModule:
    return RPNModule(cfg, in_channels)
