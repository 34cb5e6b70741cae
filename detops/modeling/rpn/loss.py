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
        """objectness [B * A, 1], deltas [B * A, 4] -> (objectness loss, box loss).

        The sampled anchors are a mask over all anchors (`sample` draws them in fixed shapes),
        and both losses are masked sums divided by the number of sampled anchors on the
        device, so nothing is read back to the host."""
        labels, matched_boxes = self.prepare_targets(anchors, targets)
        labels = torch.stack(labels)  # [B, A]: 1, 0, -1
        idx, ok = self.fg_bg_sampler.sample(labels)
        sampled = torch.zeros_like(labels).scatter_add_(1, idx, ok.to(labels.dtype)).flatten() > 0
        labels = labels.flatten()
        positive = sampled & (labels > 0)
        count = sampled.sum().clamp(min=1)
        regression_targets = self.box_coder.encode(torch.cat(matched_boxes), torch.cat(anchors))
        # anchors of an image without gt encode zero boxes (infinite log-sizes): zero them
        regression_targets = torch.where(positive[:, None], regression_targets, 0.0)
        box = F.smooth_l1_loss(deltas.float(), regression_targets, beta=1 / 9, reduction="none").sum(1)
        box_loss = torch.where(positive, box, 0.0).sum() / count
        obj = F.binary_cross_entropy_with_logits(objectness.flatten().float(), labels.clamp(min=0), reduction="none")
        obj_loss = torch.where(sampled, obj, 0.0).sum() / count
        return obj_loss, box_loss
