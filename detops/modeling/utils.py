"""Small helpers shared by the RPN and the RoI heads."""
from __future__ import annotations

from typing import List, NamedTuple, Tuple

import torch
from torch import Tensor

from ..structures import BoxList


def cat(tensors: List[Tensor], dim: int = 0) -> Tensor:
    """torch.cat that skips the copy for a single tensor."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim)


def top_k_per_group(group: Tensor, order: Tensor, k: int, num_groups: int) -> Tuple[Tensor, List[int]]:
    """Keep the first `k` entries of each group, in order, and sort them by group.

    Args:
        group (Tensor[N] int64): the group (image) of every candidate.
        order (Tensor[K] int64): indices of candidates, best first (as returned by NMS).
        k (int): entries kept per group.
        num_groups (int): number of groups.
    Returns:
        (indices grouped by group, best first within each group; per-group counts). The counts
        are the one host read, needed to split the result into per-image tensors.
    """
    g = group[order]
    by_group = torch.argsort(g, stable=True)
    g_sorted = g[by_group]
    counts = torch.bincount(g_sorted, minlength=num_groups)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(g_sorted.numel(), device=g.device) - starts[g_sorted]
    keep = rank < k
    kept = order[by_group[keep]]
    return kept, torch.clamp(counts, max=k).tolist()


class PaddedTargets(NamedTuple):
    """The gt of a batch in fixed shapes: G rows per image, the first len(target) of them real."""
    boxes: Tensor  # [B, G, 4], zeros on padding
    labels: Tensor  # [B, G] int64, 0 on padding (zeros when the targets have no "labels")
    valid: Tensor  # [B, G] bool


def pad_targets(targets: List[BoxList], multiple: int = 8) -> PaddedTargets:
    """Pads every image's gt to G rows, G the largest count rounded up to a multiple of
    `multiple` (at least `multiple`), so that batches whose counts differ a little share
    shapes. The targets' boxes must be xyxy. A handful of launches whatever the batch size, no
    host sync."""
    counts = [len(t) for t in targets]
    g = max(multiple, -(-max(counts, default=0) // multiple) * multiple)
    b, device = len(targets), targets[0].bbox.device
    rows = host_tensor([i * g + j for i, n in enumerate(counts) for j in range(n)], torch.int64, device)
    src = cat([t.bbox for t in targets])
    boxes = src.new_zeros(b * g, 4).index_copy_(0, rows, src).view(b, g, 4)
    valid = torch.zeros(b * g, dtype=torch.bool, device=device).index_fill_(0, rows, True).view(b, g)
    labels = torch.zeros(b * g, dtype=torch.int64, device=device)
    if all(t.has_field("labels") for t in targets):
        labels.index_copy_(0, rows, cat([t.get_field("labels").to(torch.int64) for t in targets]))
    return PaddedTargets(boxes, labels.view(b, g), valid)


def host_tensor(data, dtype: torch.dtype, device: torch.device) -> Tensor:
    """`torch.tensor(data)` on `device` without a host sync: a CUDA copy goes through pinned
    memory with non_blocking (a plain copy from pageable memory waits for the stream)."""
    t = torch.tensor(data, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class PendingCounts:
    """Small integer counts computed on the device, on their way to the host.

    On CUDA the copy goes to pinned memory without blocking, and an event marks its place in
    the stream; `get()` waits for that event only, so the host waits for the work queued
    before the counts, not for what it queued after them. On CPU the counts are read at once.
    """

    def __init__(self, counts: Tensor):
        self._event = None
        if counts.is_cuda:
            self._host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
            self._host.copy_(counts, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = counts

    def get(self) -> List[int]:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()
