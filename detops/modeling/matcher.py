"""Matcher: assigns each prediction (anchor / proposal) the ground-truth box it overlaps most."""
from __future__ import annotations

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
        if match_quality_matrix.numel() == 0:
            if match_quality_matrix.shape[0] == 0:  # no gt: everything is background
                return torch.full(
                    (match_quality_matrix.shape[1],), self.BELOW_LOW_THRESHOLD, dtype=torch.int64,
                    device=match_quality_matrix.device,
                )
            raise ValueError("Matcher: no predictions to match against the ground truth")
        matched_vals, matches = match_quality_matrix.max(dim=0)
        all_matches = matches.clone() if self.allow_low_quality_matches else None
        below = matched_vals < self.low_threshold
        between = (matched_vals >= self.low_threshold) & (matched_vals < self.high_threshold)
        matches[below] = self.BELOW_LOW_THRESHOLD
        matches[between] = self.BETWEEN_THRESHOLDS
        if all_matches is not None:
            best_per_gt, _ = match_quality_matrix.max(dim=1)
            # predictions that tie for some gt's best IoU; a mask, not indices: no host sync
            ties = (match_quality_matrix == best_per_gt[:, None]).any(dim=0)
            matches = torch.where(ties, all_matches, matches)
        return matches
