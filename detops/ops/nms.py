"""Non-maximum suppression: `nms` and per-category `batched_nms`, torchvision's semantics.

NaN and infinity (the same rule on every device):
  * a box whose score is NaN is never kept and suppresses nothing;
  * IoU is computed in IEEE arithmetic, and a NaN IoU is never above the threshold: a box with
    a NaN coordinate (its area is NaN) suppresses nothing and is never suppressed, so it is
    kept whenever its score is not NaN; infinite coordinates follow the same arithmetic;
  * +inf / -inf scores rank first / last like any other number.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ._utils import as_float

__all__ = ["nms", "batched_nms"]


def nms(boxes: Tensor, scores: Tensor, iou_threshold: float) -> Tensor:
    """Greedy non-maximum suppression.

    Args:
        boxes (Tensor[N, 4]): x1, y1, x2, y2 with 0 <= x1 < x2 and 0 <= y1 < y2 expected
            (any values are accepted). float32, float64, float16 or bfloat16; IoU is computed
            in float32 (float64 for float64 boxes).
        scores (Tensor[N]): score of each box, any float dtype.
        iou_threshold (float): a box is discarded when its IoU with a kept, higher-scored box
            is strictly greater than this.

    Returns:
        Tensor[K] int64: indices of the kept boxes by decreasing score; equal scores keep their
        original order.
    """
    return torch.ops.detops.nms(boxes, scores, as_float(iou_threshold, "detops.nms", "iou_threshold"))


def batched_nms(boxes: Tensor, scores: Tensor, idxs: Tensor, iou_threshold: float) -> Tensor:
    """Non-maximum suppression within each category: boxes of different categories never
    suppress each other. One op call for all categories (no per-category loop, no host sync
    per category, no coordinate-offset trick that could overflow float16).

    Args:
        boxes (Tensor[N, 4]): x1, y1, x2, y2.
        scores (Tensor[N]): score of each box.
        idxs (Tensor[N]): integer category of each box.
        iou_threshold (float): IoU above which a lower-scored box of the same category is
            discarded.

    Returns:
        Tensor[K] int64: indices of the kept boxes by decreasing score (ties: original order).
    """
    return torch.ops.detops.batched_nms(
        boxes, scores, idxs, as_float(iou_threshold, "detops.batched_nms", "iou_threshold")
    )


def _check_fake_nms(op: str, boxes: Tensor, scores: Tensor) -> None:
    torch._check(
        boxes.device == scores.device,
        lambda: f"{op}: boxes and scores must be on the same device, got {boxes.device} and {scores.device}",
    )
    torch._check(
        boxes.dim() == 2 and boxes.size(1) == 4,
        lambda: f"{op}: boxes must be a [N, 4] tensor, got {list(boxes.shape)}",
    )
    torch._check(scores.dim() == 1, lambda: f"{op}: scores must be a [N] tensor, got {list(scores.shape)}")
    torch._check(
        scores.size(0) == boxes.size(0),
        lambda: f"{op}: boxes and scores must have the same number of entries",
    )


@torch.library.register_fake("detops::nms")
def _nms_fake(boxes: Tensor, scores: Tensor, iou_threshold: float) -> Tensor:
    _check_fake_nms("detops.nms", boxes, scores)
    n = torch.library.get_ctx().new_dynamic_size()
    return boxes.new_empty(n, dtype=torch.int64)


@torch.library.register_fake("detops::batched_nms")
def _batched_nms_fake(boxes: Tensor, scores: Tensor, idxs: Tensor, iou_threshold: float) -> Tensor:
    _check_fake_nms("detops.batched_nms", boxes, scores)
    torch._check(idxs.dim() == 1 and idxs.size(0) == boxes.size(0), lambda: "detops.batched_nms: idxs must be a [N] tensor")
    torch._check(
        idxs.device == boxes.device,
        lambda: f"detops.batched_nms: boxes and idxs must be on the same device, got {boxes.device} and {idxs.device}",
    )
    n = torch.library.get_ctx().new_dynamic_size()
    return boxes.new_empty(n, dtype=torch.int64)
