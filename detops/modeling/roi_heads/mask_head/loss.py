"""Mask loss: per-pixel binary cross-entropy between the logits of the RoI's ground-truth class
and the gt mask cropped to the RoI and resampled to the logits' resolution."""
from __future__ import annotations

from typing import List

import torch
from torch import Tensor
from torch.nn import functional as F

from ....ops import roi_align
from ....structures import BoxList


def project_masks_on_boxes(gt_masks: Tensor, boxes: Tensor, matched_idxs: Tensor, size: int) -> Tensor:
    """Crop gt_masks[matched_idxs[i]] ([G, H, W]) to boxes[i] and resample to size x size
    (RoIAlign, one sample grid per output pixel)."""
    rois = torch.cat([matched_idxs[:, None].to(boxes), boxes], dim=1)
    return roi_align(gt_masks[:, None].to(rois), rois, (size, size), 1.0)[:, 0]


def mask_rcnn_loss(mask_logits: Tensor, positive: List[BoxList], targets: List[BoxList]) -> Tensor:
    """mask_logits [R, C, M, M] of the positive RoIs of all images -> scalar loss."""
    m = mask_logits.shape[-1]
    labels, mask_targets = [], []
    for p, t in zip(positive, targets):
        labels.append(p.get_field("labels"))
        if len(p) == 0:
            mask_targets.append(mask_logits.new_zeros((0, m, m)))
            continue
        mask_targets.append(project_masks_on_boxes(t.get_field("masks"), p.bbox, p.get_field("matched_idxs"), m))
    labels = torch.cat(labels)
    mask_targets = torch.cat(mask_targets)
    if mask_targets.numel() == 0:
        return mask_logits.sum() * 0
    idx = torch.arange(labels.shape[0], device=labels.device)
    return F.binary_cross_entropy_with_logits(mask_logits[idx, labels].float(), mask_targets.float())
