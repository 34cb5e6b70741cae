"""Box-head training: match proposals to ground truth, sample, and compute the Fast R-CNN losses."""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor
from torch.nn import functional as F

from ....structures import BoxList
from ....structures.boxlist_ops import box_iou
from ...balanced_positive_negative_sampler import BalancedPositiveNegativeSampler
from ...box_coder import BoxCoder
from ...cuda_graph import GraphedFunction, run_eagerly
from ...matcher import Matcher
from ...utils import PaddedTargets, PendingCounts, pad_targets


class FastRCNNLossComputation:
    """subsample(proposals, targets) picks the training RoIs (gt boxes are added to the
    proposals first) and attaches "labels", "regression_targets" and "matched_idxs";
    __call__(class_logits, box_regression, sampled) gives (classification loss, box loss)."""

    def __init__(self, proposal_matcher: Matcher, fg_bg_sampler: BalancedPositiveNegativeSampler, box_coder: BoxCoder,
                 graphs: Optional[GraphedFunction] = None):
        self.proposal_matcher = proposal_matcher
        self.fg_bg_sampler = fg_bg_sampler
        self.box_coder = box_coder
        self.graphs = graphs

    def subsample(self, proposals: List[BoxList], targets: List[BoxList],
                  padded_targets: Optional[PaddedTargets] = None) -> List[BoxList]:
        """The training RoIs of each image, in fixed shapes and without a host sync.

        The gt boxes are added to each image's proposals (padding proposals, "valid" False, are
        never drawn), every candidate is matched, and the sampler draws the same number of
        slots S = min(BATCH_SIZE_PER_IMAGE, candidates) for every image. Each returned BoxList
        has S boxes with "labels", "matched_idxs", "regression_targets" and "valid": slots with
        valid False are padding (label 0, zero targets) that the losses leave out. Drawn
        positives come first, and every returned BoxList carries `positive_counts`
        (a PendingCounts of the images' positive counts, in image order), so that the mask head
        can take each image's positives as its first slots. On CUDA the work after padding runs
        through CUDA graphs (`graphs`). `padded_targets` saves padding the targets again.
        """
        gt = padded_targets if padded_targets is not None else pad_targets(targets)
        n = max(len(p) for p in proposals)
        dtype = proposals[0].bbox.dtype
        if all(len(p) == n and p.has_field("valid") for p in proposals):
            boxes = torch.stack([p.bbox.detach() for p in proposals])
            valid = torch.stack([p.get_field("valid") for p in proposals])
        else:  # proposals of other lengths, or without "valid": pad them
            boxes = torch.stack([F.pad(p.bbox.detach(), (0, 0, 0, n - len(p))) for p in proposals])
            valid = torch.stack([F.pad(p.get_field("valid") if p.has_field("valid") else
                                       torch.ones(len(p), dtype=torch.bool, device=p.bbox.device), (0, n - len(p)))
                                 for p in proposals])
        m, sampler = self.proposal_matcher, self.fg_bg_sampler
        key = (m.high_threshold, m.low_threshold, m.allow_low_quality_matches, sampler.batch_size_per_image,
               sampler.positive_fraction, self.box_coder.weights)
        runner = getattr(self, "graphs", None) or run_eagerly
        boxes, labels, idxs, regression, valid, positives = runner(
            self._sample, boxes, valid, gt.boxes.to(dtype), gt.labels, gt.valid, key=key)
        counts = PendingCounts(positives)
        out = []
        for b, lab, idx, reg, v, p in zip(boxes, labels, idxs, regression, valid, proposals):
            sampled = BoxList(b, p.size, mode="xyxy")
            sampled.add_field("labels", lab)
            sampled.add_field("matched_idxs", idx)
            sampled.add_field("regression_targets", reg)
            sampled.add_field("valid", v)
            sampled.positive_counts = counts
            out.append(sampled)
        return out

    def _sample(self, boxes: Tensor, valid: Tensor, gt_boxes: Tensor, gt_labels: Tensor,
                gt_valid: Tensor) -> Tuple[Tensor, ...]:
        """[B, P, 4] proposals with their valid mask and [B, G] padded gt -> the S sampled slots
        of each image: boxes [B, S, 4], labels [B, S] (0 on padding), matched gt index [B, S],
        regression targets [B, S, 4] (zeros except on positives), valid [B, S] and each image's
        number of positives [B]."""
        candidates = torch.cat([boxes, gt_boxes], 1)  # [B, P + G, 4]
        usable = torch.cat([valid, gt_valid], 1)
        idx = self.proposal_matcher.match_batch(box_iou(gt_boxes, candidates), gt_valid)
        clamped = idx.clamp(min=0)
        labels = gt_labels.gather(1, clamped)
        labels = torch.where(idx == Matcher.BELOW_LOW_THRESHOLD, 0, labels)
        labels = torch.where((idx == Matcher.BETWEEN_THRESHOLDS) | ~usable, -1, labels)
        slots, ok = self.fg_bg_sampler.sample(labels)
        boxes = candidates.gather(1, slots[..., None].expand(-1, -1, 4))
        idxs = clamped.gather(1, slots)
        gts = gt_boxes.gather(1, idxs[..., None].expand(-1, -1, 4))
        labels = torch.where(ok, labels.gather(1, slots), 0)
        # positives only: other slots may hold zero boxes, whose encoding is not finite
        reg = self.box_coder.encode(gts.flatten(0, 1), boxes.flatten(0, 1)).view(boxes.shape)
        reg = torch.where((labels > 0)[..., None], reg, 0.0)
        return boxes, labels, idxs, reg, ok, (ok & (labels > 0)).sum(dim=1)

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
        GraphedFunction(max_graphs=cfg.MODEL.TARGETS_CUDA_GRAPHS, after=cfg.MODEL.TARGETS_CUDA_GRAPH_AFTER),
    )
