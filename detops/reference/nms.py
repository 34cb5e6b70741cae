"""Reference NMS in plain PyTorch (float64 IoU-free comparisons follow the kernels' rules)."""
from __future__ import annotations

import math

import torch
from torch import Tensor


def _acc(t: Tensor) -> Tensor:
    return t.double() if t.dtype == torch.float64 else t.float()


def iou_rows(boxes: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    """IoU of boxes[rows] against boxes[cols], [len(rows), len(cols)], in the kernels'
    arithmetic: float32 (float64 for float64 boxes), inter / ((area_i + area_j) - inter)."""
    b = _acc(boxes)
    area = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    r, c = b[rows], b[cols]
    lt = torch.maximum(r[:, None, :2], c[None, :, :2])
    rb = torch.minimum(r[:, None, 2:], c[None, :, 2:])
    # a NaN side (a NaN corner) is no overlap; an infinite one stays infinite, so that two
    # boxes with an infinite intersection get IoU inf / inf = NaN, as in the kernels
    wh = (rb - lt).clamp(min=0).nan_to_num(nan=0.0, posinf=math.inf)
    inter = wh[..., 0] * wh[..., 1]
    return inter / ((area[rows][:, None] + area[cols][None, :]) - inter)


def pairwise_iou(boxes: Tensor) -> Tensor:
    """IoU matrix [N, N]."""
    every = torch.arange(boxes.size(0), device=boxes.device)
    return iou_rows(boxes, every, every)


# Candidates whose IoU rows nms computes at a time: the rows of a block of the score order
# against the boxes from that block on still in play, so that memory stays at a block's rows
# however many boxes there are.
_ROWS_PER_BLOCK = 256


def nms(boxes: Tensor, scores: Tensor, iou_threshold: float) -> Tensor:
    """Greedy NMS: kept indices by decreasing score (ties by index), NaN scores dropped, a NaN
    IoU never suppresses."""
    n = boxes.size(0)
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=boxes.device)
    b = boxes.cpu()
    order = torch.sort(scores.cpu(), descending=True, stable=True).indices
    nan_score = torch.isnan(scores.cpu())
    removed = torch.zeros(n, dtype=torch.bool)
    keep = []
    for start in range(0, n, _ROWS_PER_BLOCK):
        window = order[start : start + _ROWS_PER_BLOCK]
        block = window[~(nan_score[window] | removed[window])]
        if block.numel() == 0:
            continue
        # every box before `start` in the order is kept or removed: the block's rows against
        # the boxes from it on still in play
        rest = order[start:]
        rest = rest[~(nan_score[rest] | removed[rest])]
        # exact comparison of the float IoU with the double threshold
        above = iou_rows(b, block, rest).double() > float(iou_threshold)
        for j, i in enumerate(block.tolist()):
            if removed[i]:
                continue
            keep.append(i)
            removed[rest[above[j]]] = True
    return torch.tensor(keep, dtype=torch.int64, device=boxes.device)


def batched_nms(boxes: Tensor, scores: Tensor, idxs: Tensor, iou_threshold: float) -> Tensor:
    """Per-category NMS: the union of `nms` over each category, by decreasing score (ties by
    index)."""
    if boxes.size(0) == 0:
        return torch.empty(0, dtype=torch.int64, device=boxes.device)
    kept = []
    for c in torch.unique(idxs.cpu()).tolist():
        sel = torch.nonzero(idxs.cpu() == c).flatten()
        kept.append(sel[nms(boxes.cpu()[sel], scores.cpu()[sel], iou_threshold)])
    # a stable sort of the index-sorted set keeps ties in index order
    kept_sorted = torch.sort(torch.cat(kept)).values
    order = torch.sort(scores.cpu()[kept_sorted], descending=True, stable=True).indices
    return kept_sorted[order].to(boxes.device)
