"""Mask loss: per-pixel binary cross-entropy between the logits of the RoI's ground-truth class
and the gt mask cropped to the RoI and resampled to the logits' resolution."""
from __future__ import annotations

from typing import List

import torch
from torch import Tensor
from torch.nn import functional as F

from ....ops import roi_align
from ....structures import BoxList
from ...utils import host_tensor


def project_masks_on_boxes(gt_masks: Tensor, boxes: Tensor, matched_idxs: Tensor, size: int) -> Tensor:
    """Crop gt_masks[matched_idxs[i]] ([G, H, W]) to boxes[i] and resample to size x size
    (RoIAlign, one sample grid per output pixel)."""
    rois = torch.cat([matched_idxs[:, None].to(boxes), boxes], dim=1)
    return roi_align(gt_masks[:, None].to(rois), rois, (size, size), 1.0)[:, 0]


def mask_rcnn_loss(mask_logits: Tensor, positive: List[BoxList], targets: List[BoxList]) -> Tensor:
    """mask_logits [R, C, M, M] of the positive RoIs of all images -> scalar loss: the mean
    per-pixel loss over the RoIs. RoIs whose "valid" field is False (padding slots) are left
    out, and the division happens on the device (no host sync). When every image's gt masks
    have one size, the targets of all images come from one RoIAlign."""
    m = mask_logits.shape[-1]
    labels = torch.cat([p.get_field("labels") for p in positive])
    valid = torch.cat([p.get_field("valid") if p.has_field("valid") else
                       torch.ones(len(p), dtype=torch.bool, device=p.bbox.device) for p in positive])
    if labels.numel() == 0:
        return mask_logits.sum() * 0
    mask_targets = _mask_targets(positive, [t.get_field("masks") for t in targets], m, mask_logits)
    r = labels.shape[0]
    logits = mask_logits.gather(1, labels[:, None, None, None].expand(r, 1, m, m))[:, 0]
    loss = F.binary_cross_entropy_with_logits(logits.float(), mask_targets.float(), reduction="none")
    return torch.where(valid, loss.mean(dim=(1, 2)), 0.0).sum() / valid.sum().clamp(min=1)


def _mask_targets(positive: List[BoxList], gt_masks: List[Tensor], m: int, like: Tensor) -> Tensor:
    """[R, m, m] targets of the positives of all images, in their order."""
    used = [(p, g) for p, g in zip(positive, gt_masks) if len(p) > 0 and g.shape[0] > 0]
    if len(used) > 1 and len({tuple(g.shape[1:]) for _, g in used}) == 1 and len(used) == len(positive):
        # one RoIAlign over the masks of all images: matched indices offset into their concatenation
        offsets, start = [], 0
        for p, g in used:
            offsets.append(start)
            start += g.shape[0]
        idx = torch.cat([p.get_field("matched_idxs") for p, _ in used])
        shift = host_tensor([o for (p, _), o in zip(used, offsets) for _ in range(len(p))], idx.dtype, idx.device)
        boxes = torch.cat([p.bbox for p, _ in used])
        return project_masks_on_boxes(torch.cat([g for _, g in used]), boxes, idx + shift, m)
    out = []
    for p, g in zip(positive, gt_masks):
        if len(p) == 0 or g.shape[0] == 0:  # no gt: no slot is a positive
            out.append(like.new_zeros((len(p), m, m)))
        else:
            out.append(project_masks_on_boxes(g, p.bbox, p.get_field("matched_idxs"), m))
    return torch.cat(out)
