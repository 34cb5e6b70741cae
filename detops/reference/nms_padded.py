"""Reference fixed-shape batched NMS in plain PyTorch: a loop over images of the reference NMS."""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from .nms import nms


def score_mask(scores: Tensor, score_threshold: float) -> Tensor:
    """scores > score_threshold, compared exactly (as real numbers); NaN never passes."""
    return scores.double() > float(score_threshold)


def nms_padded(
    boxes: Tensor, scores: Tensor, iou_threshold: float, score_threshold: float = float("-inf"), max_output: int = 100
) -> Tuple[Tensor, Tensor]:
    """boxes [B, N, 4], scores [B, N] -> (indices [B, max_output] padded with -1, counts [B])."""
    batch = boxes.size(0)
    out = torch.full((batch, max_output), -1, dtype=torch.int64)
    counts = torch.zeros(batch, dtype=torch.int64)
    for b in range(batch):
        passing = torch.nonzero(score_mask(scores[b].cpu(), score_threshold)).flatten()
        keep = passing[nms(boxes[b].cpu()[passing], scores[b].cpu()[passing], iou_threshold)][:max_output]
        out[b, : keep.numel()] = keep
        counts[b] = keep.numel()
    return out.to(boxes.device), counts.to(boxes.device)
