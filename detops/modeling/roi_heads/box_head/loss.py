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
from ...utils import PendingCounts


class FastRCNNLossComputation:
    """subsample(proposals, targets) picks the training RoIs (gt boxes are added to the
    proposals first) and attaches "labels", "regression_targets" and "matched_idxs";
    __call__(class_logits, box_regression, sampled) gives (classification loss, box loss)."""

    def __init__(self, proposal_matcher: Matcher, fg_bg_sampler: BalancedPositiveNegativeSampler, box_coder: BoxCoder):
        self.proposal_matcher = proposal_matcher
        self.fg_bg_sampler = fg_bg_sampler
        self.box_coder = box_coder

    def _match(self, proposals: Tensor, target: BoxList) -> Tuple[Tensor, Tensor, Tensor]:
        """(matched gt index clamped to >= 0, class label (0 background, -1 ignored), matched
        gt box) of each proposal."""
        gt = target.bbox
        gt_labels = target.get_field("labels")
        if gt.numel() == 0:
            n = proposals.shape[0]
            zeros = torch.zeros(n, dtype=torch.int64, device=proposals.device)
            return zeros, zeros, torch.zeros_like(proposals)
        idx = self.proposal_matcher(box_iou(gt, proposals))
        clamped = idx.clamp(min=0)
        labels = gt_labels[clamped].to(torch.int64)
        labels = torch.where(idx == Matcher.BELOW_LOW_THRESHOLD, 0, labels)
        labels = torch.where(idx == Matcher.BETWEEN_THRESHOLDS, -1, labels)
        return clamped, labels, gt[clamped]

    def subsample(self, proposals: List[BoxList], targets: List[BoxList]) -> List[BoxList]:
        """The training RoIs of each image, in fixed shapes and without a host sync.

        The gt boxes are added to each image's proposals (padding proposals, "valid" False, are
        never drawn), every candidate is matched, and the sampler draws the same number of
        slots S = min(BATCH_SIZE_PER_IMAGE, candidates) for every image. Each returned BoxList
        has S boxes with "labels", "matched_idxs", "regression_targets" and "valid": slots with
        valid False are padding (label 0, zero targets) that the losses leave out. Drawn
        positives come first, and every returned BoxList carries `positive_counts`
        (a PendingCounts of the images' positive counts, in image order), so that the mask head
        can take each image's positives as its first slots.
        """
        boxes, labels, idxs, gts = [], [], [], []
        for p, t in zip(proposals, targets):
            b = torch.cat([p.bbox.detach(), t.bbox.to(p.bbox.dtype)], 0)
            idx, lab, gt = self._match(b, t)
            if p.has_field("valid"):
                lab = torch.where(torch.cat([p.get_field("valid"), lab.new_ones(len(t), dtype=torch.bool)]), lab, -1)
            boxes.append(b)
            labels.append(lab)
            idxs.append(idx)
            gts.append(gt)
        # images differ in gt counts: pad the candidates to the longest, with label -1
        n = max(b.shape[0] for b in boxes)
        boxes = torch.stack([F.pad(b, (0, 0, 0, n - b.shape[0])) for b in boxes])
        gts = torch.stack([F.pad(g, (0, 0, 0, n - g.shape[0])) for g in gts])
        labels = torch.stack([F.pad(x, (0, n - x.shape[0]), value=-1) for x in labels])
        idxs = torch.stack([F.pad(x, (0, n - x.shape[0])) for x in idxs])
        slots, valid = self.fg_bg_sampler.sample(labels)
        boxes = boxes.gather(1, slots[..., None].expand(-1, -1, 4))
        gts = gts.gather(1, slots[..., None].expand(-1, -1, 4))
        labels = torch.where(valid, labels.gather(1, slots), 0)
        idxs = idxs.gather(1, slots)
        counts = PendingCounts((valid & (labels > 0)).sum(dim=1))
        out = []
        for b, lab, idx, gt, v, p in zip(boxes, labels, idxs, gts, valid, proposals):
            sampled = BoxList(b, p.size, mode="xyxy")
            sampled.add_field("labels", lab)
            sampled.add_field("matched_idxs", idx)
            # positives only: other slots may hold zero boxes, whose encoding is not finite
            reg = self.box_coder.encode(gt, b)
            sampled.add_field("regression_targets", torch.where((lab > 0)[:, None], reg, 0.0))
            sampled.add_field("valid", v)
            sampled.positive_counts = counts
            out.append(sampled)
        return out

    def __call__(self, class_logits: Tensor, box_regression: Tensor, sampled: List[BoxList]) -> Tuple[Tensor, Tensor]:
        """Cross-entropy over the valid slots, smooth L1 of the positives' class-specific
        deltas; both divided by the number of valid slots (on the device: no host sync)."""
        labels = torch.cat([s.get_field("labels") for s in sampled])
        targets = torch.cat([s.get_field("regression_targets") for s in sampled])
        valid = torch.cat([s.get_field("valid") for s in sampled])
        count = valid.sum().clamp(min=1)
        ce = F.cross_entropy(class_logits.float(), labels, reduction="none")
        cls_loss = torch.where(valid, ce, 0.0).sum() / count
        n = class_logits.shape[0]
        # gather, not advanced indexing: its backward (a scatter-add) needs no host sync
        reg = box_regression.reshape(n, -1, 4).gather(1, labels[:, None, None].expand(n, 1, 4))[:, 0]
        box = F.smooth_l1_loss(reg.float(), targets, beta=1 / 9, reduction="none").sum(1)
        box_loss = torch.where(valid & (labels > 0), box, 0.0).sum() / count
        return cls_loss, box_loss


def make_roi_box_loss_evaluator(cfg) -> FastRCNNLossComputation:
    h = cfg.MODEL.ROI_HEADS
    return FastRCNNLossComputation(
        Matcher(h.FG_IOU_THRESHOLD, h.BG_IOU_THRESHOLD, allow_low_quality_matches=False),
        BalancedPositiveNegativeSampler(h.BATCH_SIZE_PER_IMAGE, h.POSITIVE_FRACTION),
        BoxCoder(h.BBOX_REG_WEIGHTS),
    )
