"""Mask post-processing: probabilities of the detected class, and pasting them into the image."""
from __future__ import annotations

from typing import List, Tuple

import torch
from torch import Tensor
from torch.nn import functional as F

from ....structures import BoxList


def mask_probabilities(mask_logits: Tensor, detections: List[BoxList]) -> None:
    """Attach "mask" ([n, 1, M, M] sigmoid of the detected class's logits) to each image's detections."""
    probs = mask_logits.sigmoid()
    labels = torch.cat([d.get_field("labels") for d in detections])
    probs = probs[torch.arange(labels.shape[0], device=labels.device), labels][:, None]
    for d, p in zip(detections, probs.split([len(d) for d in detections])):
        d.add_field("mask", p)


def _expand(masks: Tensor, boxes: Tensor, padding: int) -> Tuple[Tensor, Tensor]:
    """Pad the M x M masks by `padding` pixels and grow the boxes by the same factor, so that the
    bilinear resize reaches the box border."""
    m = masks.shape[-1]
    scale = float(m + 2 * padding) / m
    masks = F.pad(masks, (padding,) * 4)
    half_w = (boxes[:, 2] - boxes[:, 0]) * 0.5 * scale
    half_h = (boxes[:, 3] - boxes[:, 1]) * 0.5 * scale
    cx = (boxes[:, 2] + boxes[:, 0]) * 0.5
    cy = (boxes[:, 3] + boxes[:, 1]) * 0.5
    return masks, torch.stack([cx - half_w, cy - half_h, cx + half_w, cy + half_h], dim=1)


def _paste_one(mask: Tensor, box: List[int], im_h: int, im_w: int) -> Tensor:
    x0, y0, x1, y1 = box
    w = max(x1 - x0 + 1, 1)
    h = max(y1 - y0 + 1, 1)
    resized = F.interpolate(mask[None, None], size=(h, w), mode="bilinear", align_corners=False)[0, 0]
    out = mask.new_zeros((im_h, im_w))
    xa, xb = max(x0, 0), min(x1 + 1, im_w)
    ya, yb = max(y0, 0), min(y1 + 1, im_h)
    if xb > xa and yb > ya:
        out[ya:yb, xa:xb] = resized[ya - y0:yb - y0, xa - x0:xb - x0]
    return out


def paste_masks_in_image(masks: Tensor, boxes: Tensor, image_size: Tuple[int, int], padding: int = 1) -> Tensor:
    """Masks [N, 1, M, M] (probabilities) placed at their boxes [N, 4] in an image of
    image_size (h, w): [N, 1, h, w]. Boxes are padded, rounded down to integer pixels, and
    each mask is resized bilinearly to its box (inclusive of the far pixel)."""
    im_h, im_w = image_size
    if masks.shape[0] == 0:
        return masks.new_empty((0, 1, im_h, im_w))
    masks, boxes = _expand(masks[:, 0], boxes, padding)
    int_boxes = boxes.to(torch.int64).tolist()
    return torch.stack([_paste_one(m, b, im_h, im_w) for m, b in zip(masks, int_boxes)])[:, None]
