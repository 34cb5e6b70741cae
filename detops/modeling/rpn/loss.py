"""RPN losses: objectness (binary cross-entropy) and box regression (smooth L1) on a balanced
sample of anchors per image."""
from __future__ import annotations

from typing import List, Tuple

import torch
from torch import Tensor
from torch.nn import functional as F

from ...structures import BoxList
from ...structures.boxlist_ops import box_iou
from ..balanced_positive_negative_sampler import BalancedPositiveNegativeSampler
from ..box_coder import BoxCoder
from ..matcher import Matcher


class RPNLossComputation:
    """Args:
    proposal_matcher (Matcher): anchors vs ground truth (fg >= 0.7, bg < 0.3, low-quality matches kept).
    fg_bg_sampler (BalancedPositiveNegativeSampler): anchors sampled per image.
    box_coder (BoxCoder): encodes regression targets.
    """

    def __init__(self, proposal_matcher: Matcher, fg_bg_sampler: BalancedPositiveNegativeSampler, box_coder: BoxCoder):
        self.proposal_matcher = proposal_matcher
        self.fg_bg_sampler = fg_bg_sampler
        self.box_coder = box_coder

    def prepare_targets(self, anchors: List[Tensor], targets: List[BoxList]) -> Tuple[List[Tensor], List[Tensor]]:
        """Per image: labels (1 fg, 0 bg, -1 ignored) and matched gt boxes of every anchor."""
        labels, matched_boxes = [], []
        for a, t in zip(anchors, targets):
            gt = t.bbox
            if gt.numel() == 0:
                labels.append(torch.zeros(a.shape[0], dtype=torch.float32, device=a.device))
                matched_boxes.append(torch.zeros_like(a))
                continue
            idx = self.proposal_matcher(box_iou(gt, a))
            matched_boxes.append(gt[idx.clamp(min=0)])
            lab = (idx >= 0).to(torch.float32)
            lab[idx == Matcher.BELOW_LOW_THRESHOLD] = 0.0
            lab[idx == Matcher.BETWEEN_THRESHOLDS] = -1.0
            labels.append(lab)
        return labels, matched_boxes

    def __call__(self, anchors: List[Tensor], objectness: Tensor, deltas: Tensor,
                 targets: List[BoxList]) -> Tuple[Tensor, Tensor]:
        """objectness [B * A, 1], deltas [B * A, 4] -> (objectness loss, box loss)."""
        labels, matched_boxes = self.prepare_targets(anchors, targets)
        pos_masks, neg_masks = self.fg_bg_sampler(labels)
        pos = torch.where(torch.cat(pos_masks))[0]
        sampled = torch.where(torch.cat(pos_masks) | torch.cat(neg_masks))[0]
        labels = torch.cat(labels)
        regression_targets = self.box_coder.encode(torch.cat(matched_boxes), torch.cat(anchors))
        objectness = objectness.flatten()
        box_loss = F.smooth_l1_loss(deltas[pos].float(), regression_targets[pos], beta=1 / 9, reduction="sum") / max(
            sampled.numel(), 1)
        obj_loss = F.binary_cross_entropy_with_logits(objectness[sampled].float(), labels[sampled])
        return obj_loss, box_loss
