"""Box-head training: match proposals to ground truth, sample, and compute the Fast R-CNN losses."""
from __future__ import annotations

from typing import List, Tuple

import torch
from torch import Tensor
from torch.nn import functional as F

from ....structures import BoxList
from ....structures.boxlist_ops import box_iou
from ...balanced_positive_negative_sampler import BalancedPositiveNegativeSampler
from ...box_coder import BoxCoder
from ...matcher import Matcher


class FastRCNNLossComputation:
    """subsample(proposals, targets) picks the training RoIs (gt boxes are added to the
    proposals first) and attaches "labels", "regression_targets" and "matched_idxs";
    __call__(class_logits, box_regression, sampled) gives (classification loss, box loss)."""

    def __init__(self, proposal_matcher: Matcher, fg_bg_sampler: BalancedPositiveNegativeSampler, box_coder: BoxCoder):
        self.proposal_matcher = proposal_matcher
        self.fg_bg_sampler = fg_bg_sampler
        self.box_coder = box_coder

    def _match(self, proposals: Tensor, target: BoxList) -> Tuple[Tensor, Tensor, Tensor]:
        gt = target.bbox
        gt_labels = target.get_field("labels")
        if gt.numel() == 0:
            n = proposals.shape[0]
            zeros = torch.zeros(n, dtype=torch.int64, device=proposals.device)
            return zeros, zeros, torch.zeros_like(proposals)
        idx = self.proposal_matcher(box_iou(gt, proposals))
        clamped = idx.clamp(min=0)
        labels = gt_labels[clamped].to(torch.int64)
        labels[idx == Matcher.BELOW_LOW_THRESHOLD] = 0
        labels[idx == Matcher.BETWEEN_THRESHOLDS] = -1
        return clamped, labels, gt[clamped]

    def subsample(self, proposals: List[BoxList], targets: List[BoxList]) -> List[BoxList]:
        out = []
        with_gt = [torch.cat([p.bbox.detach(), t.bbox.to(p.bbox.dtype)], 0) for p, t in zip(proposals, targets)]
        matched = [self._match(b, t) for b, t in zip(with_gt, targets)]
        pos_masks, neg_masks = self.fg_bg_sampler([m[1] for m in matched])
        for boxes, (idx, labels, gt_boxes), pos, neg, p in zip(with_gt, matched, pos_masks, neg_masks, proposals):
            keep = torch.where(pos | neg)[0]
            sampled = BoxList(boxes[keep], p.size, mode="xyxy")
            sampled.add_field("labels", labels[keep])
            sampled.add_field("matched_idxs", idx[keep])
            sampled.add_field("regression_targets", self.box_coder.encode(gt_boxes[keep], boxes[keep]))
            out.append(sampled)
        return out

    def __call__(self, class_logits: Tensor, box_regression: Tensor, sampled: List[BoxList]) -> Tuple[Tensor, Tensor]:
        labels = torch.cat([s.get_field("labels") for s in sampled])
        targets = torch.cat([s.get_field("regression_targets") for s in sampled])
        cls_loss = F.cross_entropy(class_logits.float(), labels)
        pos = torch.where(labels > 0)[0]
        n = class_logits.shape[0]
        reg = box_regression.reshape(n, -1, 4)[pos, labels[pos]]
        box_loss = F.smooth_l1_loss(reg.float(), targets[pos], beta=1 / 9, reduction="sum") / max(labels.numel(), 1)
        return cls_loss, box_loss


def make_roi_box_loss_evaluator(cfg) -> FastRCNNLossComputation:
    h = cfg.MODEL.ROI_HEADS
    return FastRCNNLossComputation(
        Matcher(h.FG_IOU_THRESHOLD, h.BG_IOU_THRESHOLD, allow_low_quality_matches=False),
        BalancedPositiveNegativeSampler(h.BATCH_SIZE_PER_IMAGE, h.POSITIVE_FRACTION),
        BoxCoder(h.BBOX_REG_WEIGHTS),
    )
