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
    """

    def __init__(self, batch_size_per_image: int, positive_fraction: float):
        self.batch_size_per_image = batch_size_per_image
        self.positive_fraction = positive_fraction

    def __call__(self, matched_idxs: List[Tensor]) -> Tuple[List[Tensor], List[Tensor]]:
        pos_masks, neg_masks = [], []
        for labels in matched_idxs:
            positive = torch.where(labels >= 1)[0]
            negative = torch.where(labels == 0)[0]
            num_pos = min(positive.numel(), int(self.batch_size_per_image * self.positive_fraction))
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
