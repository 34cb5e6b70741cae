"""Operations on BoxLists: IoU matrix, concatenation, small-box removal."""
from __future__ import annotations

from typing import List

import torch
from torch import Tensor

from .bounding_box import BoxList


def box_area(boxes: Tensor) -> Tensor:
    """Area of [..., N, 4] xyxy boxes."""
    return (boxes[..., 2] - boxes[..., 0]) * (boxes[..., 3] - boxes[..., 1])


def box_iou(boxes1: Tensor, boxes2: Tensor) -> Tensor:
    """IoU of every pair: [..., N, 4] x [..., M, 4] xyxy -> [..., N, M] (leading dimensions
    broadcast: [B, N, 4] x [B, M, 4] gives each batch entry's matrix)."""
    area1 = box_area(boxes1)
    area2 = box_area(boxes2)
    lt = torch.max(boxes1[..., :, None, :2], boxes2[..., None, :, :2])
    rb = torch.min(boxes1[..., :, None, 2:], boxes2[..., None, :, 2:])
    wh = (rb - lt).clamp(min=0)
    inter = wh[..., 0] * wh[..., 1]
    return inter / (area1[..., :, None] + area2[..., None, :] - inter)


def boxlist_iou(a: BoxList, b: BoxList) -> Tensor:
    """IoU matrix [len(a), len(b)] of two BoxLists of the same image."""
    if a.size != b.size:
        raise ValueError(f"boxlist_iou: the BoxLists belong to images of different sizes: {a.size} and {b.size}")
    return box_iou(a.convert("xyxy").bbox, b.convert("xyxy").bbox)


def remove_small_boxes(boxes: Tensor, min_size: float) -> Tensor:
    """Indices of the [N, 4] xyxy boxes whose width and height are both >= min_size."""
    ws, hs = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    keep = (ws >= min_size) & (hs >= min_size)
    return torch.where(keep)[0]


def cat_boxlist(bboxes: List[BoxList]) -> BoxList:
    """One BoxList from several of the same image, with the fields they all have."""
    if not bboxes:
        raise ValueError("cat_boxlist: nothing to concatenate")
    size, mode = bboxes[0].size, bboxes[0].mode
    fields = set(bboxes[0].fields())
    for b in bboxes[1:]:
        if b.size != size or b.mode != mode:
            raise ValueError("cat_boxlist: BoxLists must share image size and mode")
        fields &= set(b.fields())
    out = BoxList(torch.cat([b.bbox for b in bboxes], dim=0), size, mode)
    for f in bboxes[0].fields():
        if f in fields:
            out.add_field(f, torch.cat([b.get_field(f) for b in bboxes], dim=0))
    return out
