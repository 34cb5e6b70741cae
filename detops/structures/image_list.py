"""ImageList: images of different sizes padded into one batch tensor, with their true sizes."""
from __future__ import annotations

import math
from typing import List, Sequence, Tuple, Union

from torch import Tensor


class ImageList:
    """A padded batch [B, C, H, W] and the (height, width) of each image before padding."""

    def __init__(self, tensors: Tensor, image_sizes: List[Tuple[int, int]]):
        self.tensors = tensors
        self.image_sizes = [(int(h), int(w)) for h, w in image_sizes]

    def to(self, device) -> "ImageList":
        return ImageList(self.tensors.to(device), self.image_sizes)

    def __len__(self) -> int:
        return len(self.image_sizes)


def to_image_list(
    tensors: Union[ImageList, Tensor, Sequence[Tensor]], size_divisible: int = 0
) -> ImageList:
    """Pad images [C, H_i, W_i] with zeros, bottom and right, into one [B, C, H, W] tensor whose
    H and W are the largest image sizes rounded up to a multiple of `size_divisible`."""
    if isinstance(tensors, ImageList):
        return tensors
    if isinstance(tensors, Tensor) and tensors.dim() == 3:
        tensors = tensors[None]
    if isinstance(tensors, Tensor) and size_divisible == 0:
        return ImageList(tensors, [tuple(t.shape[-2:]) for t in tensors])
    tensors = list(tensors)
    if not tensors:
        raise ValueError("to_image_list: no images")
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor) or t.dim() != 3:
            shape = list(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"to_image_list: image {i} must be a [C, H, W] tensor, got {shape}")
    c = max(t.shape[0] for t in tensors)
    h = max(t.shape[1] for t in tensors)
    w = max(t.shape[2] for t in tensors)
    if size_divisible > 0:
        stride = float(size_divisible)
        h = int(math.ceil(h / stride) * stride)
        w = int(math.ceil(w / stride) * stride)
    batched = tensors[0].new_zeros((len(tensors), c, h, w))
    for img, pad in zip(tensors, batched):
        pad[: img.shape[0], : img.shape[1], : img.shape[2]].copy_(img)
    return ImageList(batched, [tuple(t.shape[-2:]) for t in tensors])
