"""RoIPool (max pooling over RoI bins): `roi_pool` and the `RoIPool` module, torchvision's
semantics (Fast R-CNN).

Each RoI is scaled by `spatial_scale` and rounded to whole pixels (half away from zero); its
(end - start + 1) x (end - start + 1) extent is cut into a PH x PW grid of integer bins, and
each output value is the maximum of its bin (the first one in row-major order on ties). Bins
that fall outside the feature map are empty: their output is 0 and they pass no gradient.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from ._utils import as_float, boxes_to_rois, pair

__all__ = ["roi_pool", "RoIPool"]

_OP = "detops.roi_pool"


def roi_pool(
    input: Tensor,
    boxes: Union[Tensor, List[Tensor]],
    output_size: Union[int, Sequence[int]],
    spatial_scale: float = 1.0,
) -> Tensor:
    """Max pooling of `input` over a PH x PW grid of bins in each RoI.

    Args:
        input (Tensor[B, C, H, W]): feature map, float32, float64, float16 or bfloat16; any
            memory layout (channels_last included).
        boxes (Tensor[K, 5] or list of Tensor[L, 4]): RoIs (batch index, x1, y1, x2, y2) in
            input-image coordinates, the same dtype and device as `input`; or one [L, 4]
            (x1, y1, x2, y2) tensor per image. Batch indices must be integers in [0, B).
        output_size (int or (int, int)): (PH, PW), both > 0.
        spatial_scale (float): factor from box coordinates to `input` pixels, e.g. 1/16 for a
            stride-16 feature map; finite and > 0.

    Returns:
        Tensor[K, C, PH, PW]: the maximum of each bin, 0 for an empty bin, in `input`'s dtype.

    The index of each maximum, which the backward needs, is computed and kept only when
    `input` requires a gradient and grad mode is on; otherwise (inference) the kernels skip it,
    with the same output bits. `torch.ops.detops.roi_pool` always returns (output, argmax).
    """
    rois = boxes_to_rois(boxes, _OP)
    ph, pw = pair(output_size, _OP)
    # roi_pool's output alone: its C++ autograd (csrc/autograd/roi_ops.cpp) runs roi_pool, with
    # argmax saved, when input needs a gradient, and otherwise kernels that skip argmax
    return torch.ops.detops._roi_pool_values.default(input, rois, as_float(spatial_scale, _OP, "spatial_scale"), ph, pw)


class RoIPool(nn.Module):
    """`roi_pool` as a module: RoIPool(output_size, spatial_scale)(input, boxes) -> Tensor[K, C, PH, PW]."""

    def __init__(self, output_size: Union[int, Sequence[int]], spatial_scale: float) -> None:
        super().__init__()
        self.output_size: Tuple[int, int] = pair(output_size, _OP)
        self.spatial_scale = as_float(spatial_scale, _OP, "spatial_scale")

    def forward(self, input: Tensor, rois: Union[Tensor, List[Tensor]]) -> Tensor:
        return roi_pool(input, rois, self.output_size, self.spatial_scale)

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}(output_size={self.output_size}, spatial_scale={self.spatial_scale})"


@torch.library.register_fake("detops::roi_pool")
def _roi_pool_fake(input: Tensor, rois: Tensor, spatial_scale: float, pooled_height, pooled_width):
    torch._check(input.dim() == 4, lambda: f"{_OP}: input must be a [B, C, H, W] tensor, got {list(input.shape)}")
    torch._check(
        rois.dim() == 2 and rois.size(1) == 5, lambda: f"{_OP}: rois must be a [K, 5] tensor, got {list(rois.shape)}"
    )
    torch._check(input.dtype == rois.dtype, lambda: f"{_OP}: input and rois must have the same dtype")
    torch._check(
        input.device == rois.device,
        lambda: f"{_OP}: input and rois must be on the same device, got {input.device} and {rois.device}",
    )
    torch._check(
        pooled_height > 0 and pooled_width > 0, lambda: f"{_OP}: pooled_height and pooled_width must be positive"
    )
    shape = (rois.size(0), input.size(1), pooled_height, pooled_width)
    return input.new_empty(shape), input.new_empty(shape, dtype=torch.int32)


@torch.library.register_fake("detops::_roi_pool_values")
def _roi_pool_values_fake(input: Tensor, rois: Tensor, spatial_scale: float, pooled_height, pooled_width):
    return _roi_pool_fake(input, rois, spatial_scale, pooled_height, pooled_width)[0]


@torch.library.register_fake("detops::_roi_pool_backward")
def _roi_pool_backward_fake(
    grad: Tensor,
    rois: Tensor,
    argmax: Tensor,
    spatial_scale: float,
    pooled_height,
    pooled_width,
    batch_size,
    channels,
    height,
    width,
):
    torch._check(grad.dim() == 4, lambda: f"{_OP} backward: grad must be a [K, C, PH, PW] tensor")
    torch._check(argmax.dtype == torch.int32, lambda: f"{_OP} backward: argmax must be an int32 tensor")
    torch._check(
        grad.device == rois.device and grad.device == argmax.device,
        lambda: f"{_OP} backward: grad and argmax must be on the same device, and rois too",
    )
    return grad.new_empty((batch_size, channels, height, width))
