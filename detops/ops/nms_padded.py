"""Fixed-shape batched NMS: `nms_padded`, free of host syncs and capturable in a CUDA graph."""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from ._utils import as_float, as_int

__all__ = ["nms_padded"]

_OP = "detops.nms_padded"


def nms_padded(
    boxes: Tensor,
    scores: Tensor,
    iou_threshold: float,
    score_threshold: float = float("-inf"),
    max_output: int = 100,
) -> Tuple[Tensor, Tensor]:
    """Greedy NMS on a batch of images at once, with outputs whose shapes depend only on the
    input shapes and `max_output`.

    For each image b, the boxes with ``scores[b] > score_threshold`` (compared exactly; NaN
    scores never pass, and with the default ``-inf`` only NaN and ``-inf`` scores are dropped,
    so ``-inf`` can mark padding boxes) go through greedy NMS exactly as
    :func:`detops.ops.nms` / ``torchvision.ops.nms`` (same kept boxes, same order: decreasing
    score, equal scores in their original order), and the first `max_output` kept boxes are
    returned. The result equals, per image,
    ``keep = nms(boxes[b][m], scores[b][m], iou_threshold)`` with ``m = scores[b] >
    score_threshold``, mapped back to positions in N and cut to `max_output`.

    On CUDA nothing synchronizes with the host (no ``.item()``, no device-to-host copy, no
    data-dependent size), so the op can be captured in a CUDA graph. The CUDA kernels keep a
    suppression bit mask of ``B * N * ceil(N / 64) * 8`` bytes (400 MB for B=8, N=20k); N is
    limited to 393,216 boxes per image.

    Args:
        boxes (Tensor[B, N, 4]): x1, y1, x2, y2 of each image's boxes; float32, float64,
            float16 or bfloat16 (IoU in float32, float64 for float64 boxes). A single image is
            passed as ``boxes[None]``, ``scores[None]``: the batch dimension is required.
        scores (Tensor[B, N]): score of each box, any float dtype.
        iou_threshold (float): a box is discarded when its IoU with a kept, higher-scored box
            of the same image is strictly greater than this. Finite.
        score_threshold (float): only boxes with a score strictly greater than this take part.
            Not NaN; ``-inf`` (default) keeps every score except NaN and ``-inf``.
        max_output (int): >= 0, the number of columns of the result.

    Returns:
        (indices, counts):
        indices (Tensor[B, max_output] int64): positions in N of the kept boxes of each image,
        by decreasing score, then -1 up to `max_output`;
        counts (Tensor[B] int64): the number of valid (non -1) entries of each row.
    """
    return torch.ops.detops.nms_padded(
        boxes,
        scores,
        as_float(iou_threshold, _OP, "iou_threshold"),
        as_float(score_threshold, _OP, "score_threshold"),
        as_int(max_output, _OP, "max_output"),
    )


@torch.library.register_fake("detops::nms_padded")
def _nms_padded_fake(
    boxes: Tensor, scores: Tensor, iou_threshold: float, score_threshold: float, max_output: int
) -> Tuple[Tensor, Tensor]:
    torch._check(
        boxes.dim() == 3 and boxes.size(2) == 4,
        lambda: f"{_OP}: boxes must be a [B, N, 4] tensor, got {list(boxes.shape)}",
    )
    torch._check(scores.dim() == 2, lambda: f"{_OP}: scores must be a [B, N] tensor, got {list(scores.shape)}")
    torch._check(
        scores.size(0) == boxes.size(0) and scores.size(1) == boxes.size(1),
        lambda: f"{_OP}: boxes [B, N, 4] and scores [B, N] must agree in B and N",
    )
    torch._check(max_output >= 0, lambda: f"{_OP}: max_output must be >= 0, got {max_output}")
    torch._check(
        boxes.device == scores.device,
        lambda: f"{_OP}: boxes and scores must be on the same device, got {boxes.device} and {scores.device}",
    )
    batch = boxes.size(0)
    return (
        boxes.new_empty((batch, max_output), dtype=torch.int64),
        boxes.new_empty((batch,), dtype=torch.int64),
    )
