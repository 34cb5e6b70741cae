"""Sampler of a fixed-size, class-balanced set of training examples per image."""
from __future__ import annotations

from typing import List, Tuple

import torch
from torch import Tensor


class BalancedPositiveNegativeSampler:
    """Per image, draw at most batch_size_per_image examples, of which at most
    positive_fraction are positive (label >= 1); negatives (label 0) fill the rest. Labels -1
    are never drawn.

    __call__(matched_idxs: list[Tensor[N_i]]) -> (pos_masks, neg_masks): lists of uint8 masks.
    sample(labels: Tensor[B, N]) -> (indices, valid): the same draw in fixed shapes, without a
    host synchronization (the training path of the detector).
    """

    def __init__(self, batch_size_per_image: int, positive_fraction: float):
        self.batch_size_per_image = batch_size_per_image
        self.positive_fraction = positive_fraction

    @property
    def max_positive(self) -> int:
        """The most positives drawn per image."""
        return int(self.batch_size_per_image * self.positive_fraction)

    def __call__(self, matched_idxs: List[Tensor]) -> Tuple[List[Tensor], List[Tensor]]:
        pos_masks, neg_masks = [], []
        for labels in matched_idxs:
            positive = torch.where(labels >= 1)[0]
            negative = torch.where(labels == 0)[0]
            num_pos = min(positive.numel(), self.max_positive)
            num_neg = min(negative.numel(), self.batch_size_per_image - num_pos)
            perm1 = torch.randperm(positive.numel(), device=positive.device)[:num_pos]
            perm2 = torch.randperm(negative.numel(), device=negative.device)[:num_neg]
            pos = torch.zeros_like(labels, dtype=torch.uint8)
            neg = torch.zeros_like(labels, dtype=torch.uint8)
            pos[positive[perm1]] = 1
            neg[negative[perm2]] = 1
            pos_masks.append(pos)
            neg_masks.append(neg)
        return pos_masks, neg_masks

    def sample(self, labels: Tensor) -> Tuple[Tensor, Tensor]:
        """Draw from every row of `labels` at once, in shapes that depend only on its shape.

        The draw has the distribution of __call__: min(#positives, max_positive) positives and
        min(#negatives, batch_size_per_image - that) negatives, each a uniformly random subset
        (the candidates with the smallest of independent uniform keys). Nothing is read back
        to the host.

        Args:
            labels (Tensor[B, N]): >= 1 positive, 0 negative, < 0 never drawn.
        Returns:
            (indices, valid): Tensor[B, S] int64 positions in N and Tensor[B, S] bool, with
            S = min(batch_size_per_image, N). Each row lists its drawn positives first, then its
            drawn negatives, then slots with valid False (their indices point at arbitrary
            candidates). So the positives of a row are among its first min(max_positive, N)
            slots.
        """
        if labels.dim() != 2:
            raise ValueError(f"BalancedPositiveNegativeSampler: labels must be [B, N], got {list(labels.shape)}")
        b, n = labels.shape
        s = min(self.batch_size_per_image, n)
        p = min(self.max_positive, n)
        keys = torch.rand(b, n, device=labels.device)
        never = 2.0  # above every uniform key: not a candidate
        pos_key, pos_idx = torch.where(labels >= 1, keys, never).topk(p, dim=1, largest=False)
        pos_ok = pos_key < never
        neg_key, neg_idx = torch.where(labels == 0, keys, never).topk(s, dim=1, largest=False)
        room = self.batch_size_per_image - pos_ok.sum(dim=1, keepdim=True)
        neg_ok = (neg_key < never) & (torch.arange(s, device=labels.device) < room)
        idx = torch.cat([pos_idx, neg_idx], dim=1)
        ok = torch.cat([pos_ok, neg_ok], dim=1)
        # valid slots first, in their order (positives, then negatives); S of them at most
        order = torch.argsort((~ok).to(torch.uint8), dim=1, stable=True)[:, :s]
        return idx.gather(1, order), ok.gather(1, order)
