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
    """mask_logits [R, C, M, M] of the positive RoIs of all images -> scalar loss: the mean
    per-pixel loss over the RoIs. RoIs whose "valid" field is False (padding slots) are left
    out, and the division happens on the device (no host sync)."""
    m = mask_logits.shape[-1]
    labels, mask_targets, valid = [], [], []
    for p, t in zip(positive, targets):
        labels.append(p.get_field("labels"))
        valid.append(p.get_field("valid") if p.has_field("valid") else
                     torch.ones(len(p), dtype=torch.bool, device=p.bbox.device))
        gt_masks = t.get_field("masks")
        if len(p) == 0 or gt_masks.shape[0] == 0:  # no gt: no slot is a positive
            mask_targets.append(mask_logits.new_zeros((len(p), m, m)))
            continue
        mask_targets.append(project_masks_on_boxes(gt_masks, p.bbox, p.get_field("matched_idxs"), m))
    labels = torch.cat(labels)
    mask_targets = torch.cat(mask_targets)
    valid = torch.cat(valid)
    if mask_targets.numel() == 0:
        return mask_logits.sum() * 0
    r = labels.shape[0]
    logits = mask_logits.gather(1, labels[:, None, None, None].expand(r, 1, m, m))[:, 0]
    loss = F.binary_cross_entropy_with_logits(logits.float(), mask_targets.float(), reduction="none")
    return torch.where(valid, loss.mean(dim=(1, 2)), 0.0).sum() / valid.sum().clamp(min=1)
