"""RPN losses: objectness (binary cross-entropy) and box regression (smooth L1) on a balanced
sample of anchors per image."""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor
from torch.nn import functional as F

from ...structures.boxlist_ops import box_iou
from ..balanced_positive_negative_sampler import BalancedPositiveNegativeSampler
from ..box_coder import BoxCoder
from ..matcher import Matcher


class RPNLossComputation:
    """Args:
    proposal_matcher (Matcher): anchors vs ground truth (fg >= 0.7, bg < 0.3, low-quality matches kept).
    fg_bg_sampler (BalancedPositiveNegativeSampler): anchors sampled per image.
    box_coder (BoxCoder): encodes regression targets.

    targets(anchors, gt_boxes, gt_valid) draws the anchors and builds their targets (no
    gradients: the RPN runs it through CUDA graphs); losses(objectness, deltas, *targets) gives
    (objectness loss, box loss).
    """

    def __init__(self, proposal_matcher: Matcher, fg_bg_sampler: BalancedPositiveNegativeSampler, box_coder: BoxCoder):
        self.proposal_matcher = proposal_matcher
        self.fg_bg_sampler = fg_bg_sampler
        self.box_coder = box_coder

    def targets(self, anchors: Tensor, gt_boxes: Tensor, gt_valid: Tensor) -> Tuple[Tensor, ...]:
        """The sampled anchors of every image and their training targets, in fixed shapes (no
        host sync).

        Args:
            anchors (Tensor[B, A, 4]): each image's anchors.
            gt_boxes (Tensor[B, G, 4]), gt_valid (Tensor[B, G] bool): each image's gt, padded
                (`detops.modeling.utils.pad_targets`).
        Returns:
            (slots, labels, sampled, positive, regression_targets, count): the S anchors drawn
            per image (Tensor[B, S] int64 positions in A, as `BalancedPositiveNegativeSampler.
            sample` gives them), their labels (Tensor[B, S] float, 1 foreground, 0 background),
            which slots hold a drawn anchor and which a foreground one (two Tensor[B, S] bool),
            the regression targets (Tensor[B, S, 4], zeros except on positives) and the number
            of drawn anchors (at least 1) as a float scalar tensor.
        """
        idx = self.proposal_matcher.match_batch(box_iou(gt_boxes, anchors), gt_valid)  # [B, A]
        labels = torch.where(idx >= 0, 1.0, torch.where(idx == Matcher.BETWEEN_THRESHOLDS, -1.0, 0.0))
        slots, sampled = self.fg_bg_sampler.sample(labels)
        labels = labels.gather(1, slots).clamp(min=0)
        positive = sampled & (labels > 0)
        matched = gt_boxes.gather(1, idx.gather(1, slots).clamp(min=0)[..., None].expand(-1, -1, 4))
        drawn = anchors.gather(1, slots[..., None].expand(-1, -1, 4))
        regression_targets = self.box_coder.encode(matched.flatten(0, 1), drawn.flatten(0, 1)).view(drawn.shape)
        # anchors matched to padding (images without gt) encode zero boxes (infinite log-sizes)
        regression_targets = torch.where(positive[..., None], regression_targets, 0.0)
        return slots, labels, sampled, positive, regression_targets, sampled.sum().clamp(min=1).to(labels.dtype)

    @staticmethod
    def losses(objectness: Tensor, deltas: Tensor, slots: Tensor, labels: Tensor, sampled: Tensor, positive: Tensor,
               regression_targets: Tensor, count: Tensor) -> Tuple[Tensor, Tensor]:
        """objectness [B * A, 1] and deltas [B * A, 4] against `targets`' outputs -> (objectness
        loss, box loss) over the drawn anchors: masked sums divided by their number on the
        device. The gathers' backward scatters into the drawn anchors only."""
        b = slots.shape[0]
        obj = objectness.reshape(b, -1).gather(1, slots)
        reg = deltas.reshape(b, -1, 4).gather(1, slots[..., None].expand(-1, -1, 4))
        box = F.smooth_l1_loss(reg.float(), regression_targets, beta=1 / 9, reduction="none").sum(2)
        box_loss = torch.where(positive, box, 0.0).sum() / count
        obj = F.binary_cross_entropy_with_logits(obj.float(), labels, reduction="none")
        obj_loss = torch.where(sampled, obj, 0.0).sum() / count
        return obj_loss, box_loss
