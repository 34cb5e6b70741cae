"""Reference NMS in plain PyTorch (float64 IoU-free comparisons follow the kernels' rules)."""
from __future__ import annotations

import torch
from torch import Tensor


def _acc(t: Tensor) -> Tensor:
    return t.double() if t.dtype == torch.float64 else t.float()


def pairwise_iou(boxes: Tensor) -> Tensor:
    """IoU matrix [N, N] in the kernels' arithmetic: float32 (float64 for float64 boxes),
    inter / ((area_i + area_j) - inter)."""
    b = _acc(boxes)
    area = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    lt = torch.maximum(b[:, None, :2], b[None, :, :2])
    rb = torch.minimum(b[:, None, 2:], b[None, :, 2:])
    wh = (rb - lt).clamp(min=0).nan_to_num(nan=0.0)
    inter = wh[..., 0] * wh[..., 1]
    return inter / ((area[:, None] + area[None, :]) - inter)


def nms(boxes: Tensor, scores: Tensor, iou_threshold: float) -> Tensor:
    """Greedy NMS: kept indices by decreasing score (ties by index), NaN scores dropped, a NaN
    IoU never suppresses."""
    n = boxes.size(0)
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=boxes.device)
    iou = pairwise_iou(boxes.cpu())
    # exact comparison of the float IoU with the double threshold
    above = iou.double() > float(iou_threshold)
    order = torch.sort(scores.cpu(), descending=True, stable=True).indices
    nan_score = torch.isnan(scores.cpu())
    removed = torch.zeros(n, dtype=torch.bool)
    keep = []
    for i in order.tolist():
        if nan_score[i] or removed[i]:
            continue
        keep.append(i)
        removed |= above[i]
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
