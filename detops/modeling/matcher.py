"""Matcher: assigns each prediction (anchor / proposal) the ground-truth box it overlaps most."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


class Matcher:
    """Match by IoU.

    Each column (prediction) of a [M gt, N pred] IoU matrix gets the index of its best gt when
    that IoU >= high_threshold, BELOW_LOW_THRESHOLD (-1, background) when < low_threshold and
    BETWEEN_THRESHOLDS (-2, ignored) in between. With allow_low_quality_matches, every
    prediction that ties for the best IoU of some gt keeps its match even if below the high
    threshold (so every gt gets at least one prediction).
    """

    BELOW_LOW_THRESHOLD = -1
    BETWEEN_THRESHOLDS = -2

    def __init__(self, high_threshold: float, low_threshold: float, allow_low_quality_matches: bool = False):
        if low_threshold > high_threshold:
            raise ValueError(f"Matcher: low_threshold {low_threshold} exceeds high_threshold {high_threshold}")
        self.high_threshold = high_threshold
        self.low_threshold = low_threshold
        self.allow_low_quality_matches = allow_low_quality_matches

    def __call__(self, match_quality_matrix: Tensor) -> Tensor:
        """[M, N] IoU -> [N] int64 gt index, or -1 / -2."""
        if match_quality_matrix.dim() != 2:
            raise ValueError(f"Matcher: the quality matrix must be [M, N], got {list(match_quality_matrix.shape)}")
        if match_quality_matrix.shape[1] == 0 and match_quality_matrix.shape[0] > 0:
            raise ValueError("Matcher: no predictions to match against the ground truth")
        return self.match_batch(match_quality_matrix[None])[0]

    def match_batch(self, quality: Tensor, gt_valid: Optional[Tensor] = None) -> Tensor:
        """The matches of several images at once, in fixed shapes (no host sync).

        Args:
            quality (Tensor[B, M, N]): IoU of each image's M gt (padded) with its N predictions.
            gt_valid (Tensor[B, M] bool, optional): False on padding gt rows, which match nothing.
        Returns:
            Tensor[B, N] int64: per image what __call__ gives for its valid rows alone (an
            image without valid gt: every prediction BELOW_LOW_THRESHOLD).
        """
        b, m, n = quality.shape
        if m == 0:  # no gt: everything is background
            return torch.full((b, n), self.BELOW_LOW_THRESHOLD, dtype=torch.int64, device=quality.device)
        if gt_valid is not None:  # IoU lies in [0, 1]: padding rows never win
            quality = torch.where(gt_valid[:, :, None], quality, -1.0)
        matched_vals, matches = quality.max(dim=1)
        all_matches = matches if self.allow_low_quality_matches else None
        matches = torch.where(matched_vals < self.low_threshold, self.BELOW_LOW_THRESHOLD,
                              torch.where(matched_vals < self.high_threshold, self.BETWEEN_THRESHOLDS, matches))
        if all_matches is not None:
            best_per_gt, _ = quality.max(dim=2)
            # predictions that tie for some valid gt's best IoU; a mask, not indices: no host sync
            ties = quality == best_per_gt[:, :, None]
            if gt_valid is not None:
                ties &= gt_valid[:, :, None]
            matches = torch.where(ties.any(dim=1), all_matches, matches)
        return matches
