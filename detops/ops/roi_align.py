"""RoIAlign (Mask R-CNN's bilinear RoI pooling), torchvision's semantics.

Each RoI is cut into output_size bins; a bin is the mean of bilinear samples of the feature
map taken on a regular grid inside it (sampling_ratio per axis, or ceil(bin size) when
sampling_ratio <= 0). Samples further than one pixel outside the map count as 0.

Autograd is registered on the op itself, in C++ (csrc/autograd/roi_ops.cpp), so
`torch.ops.detops.roi_align` is differentiable, passes `torch.library.opcheck`, and a call runs
no Python past `roi_align`'s own few lines. The backward op is not differentiable (no double
backward).

On CUDA with `torch.use_deterministic_algorithms(True)` the backward runs a deterministic
kernel (bit-identical from run to run); otherwise it accumulates with atomics.
"""
from __future__ import annotations

from typing import List, Sequence, Union

import torch
from torch import Tensor, nn

from ._utils import as_float, as_int, boxes_to_rois, pair

__all__ = ["roi_align", "RoIAlign"]

_OP = "detops.roi_align"


def roi_align(
    input: Tensor,
    boxes: Union[Tensor, List[Tensor]],
    output_size: Union[int, Sequence[int]],
    spatial_scale: float = 1.0,
    sampling_ratio: int = -1,
    aligned: bool = False,
) -> Tensor:
    """RoIAlign, as `torchvision.ops.roi_align`.

    Args:
        input (Tensor[B, C, H, W]): feature maps; float32, float64, float16 or bfloat16, any
            memory layout (channels_last included). Sums are accumulated in float32 (float64
            for float64).
        boxes (Tensor[K, 5] or List[Tensor[L, 4]]): RoIs in input-image coordinates. A [K, 5]
            tensor holds (batch index, x1, y1, x2, y2), the batch index an integer value in
            [0, B); a list holds one [L, 4] tensor (x1, y1, x2, y2) per image. Same dtype and
            device as input.
        output_size (int or Tuple[int, int]): (PH, PW), the bins per RoI.
        spatial_scale (float): maps box coordinates onto the feature map (e.g. 1/16); > 0.
        sampling_ratio (int): samples per bin along each axis; <= 0 picks
            ceil(roi size / output size) per RoI.
        aligned (bool): shift box coordinates by -0.5 pixel so that sample points sit on pixel
            centres (Detectron2's ROIAlignV2); False keeps the legacy rounding, in which RoIs
            are at least 1x1.

    Returns:
        Tensor[K, C, PH, PW]: contiguous, in input's dtype.
    """
    ph, pw = pair(output_size, _OP)
    rois = boxes_to_rois(boxes, _OP)
    return torch.ops.detops.roi_align.default(
        input,
        rois,
        as_float(spatial_scale, _OP, "spatial_scale"),
        ph,
        pw,
        as_int(sampling_ratio, _OP, "sampling_ratio"),
        bool(aligned),
    )


class RoIAlign(nn.Module):
    """`roi_align` as a module; see `roi_align` for the arguments.

    forward(input (Tensor[B, C, H, W]), rois (Tensor[K, 5] or List[Tensor[L, 4]]))
        -> Tensor[K, C, PH, PW]
    """

    def __init__(
        self,
        output_size: Union[int, Sequence[int]],
        spatial_scale: float,
        sampling_ratio: int,
        aligned: bool = False,
    ) -> None:
        super().__init__()
        self.output_size = pair(output_size, _OP)
        self.spatial_scale = as_float(spatial_scale, _OP, "spatial_scale")
        self.sampling_ratio = as_int(sampling_ratio, _OP, "sampling_ratio")
        self.aligned = bool(aligned)

    def forward(self, input: Tensor, rois: Union[Tensor, List[Tensor]]) -> Tensor:
        return roi_align(input, rois, self.output_size, self.spatial_scale, self.sampling_ratio, self.aligned)

    def __repr__(self) -> str:
        return (
            f"{self.__class__.__name__}(output_size={self.output_size}, "
            f"spatial_scale={self.spatial_scale}, sampling_ratio={self.sampling_ratio}, "
            f"aligned={self.aligned})"
        )


# --- fake (meta) kernels for torch.compile / export --------------------------------------------


def _check_fake_common(op: str, arg: str, t: Tensor, rois: Tensor, ph: int, pw: int) -> None:
    torch._check(
        t.device == rois.device,
        lambda: f"{op}: {arg} and rois must be on the same device, got {t.device} and {rois.device}",
    )
    torch._check(
        rois.dim() == 2 and rois.size(1) == 5,
        lambda: f"{op}: rois must be a [K, 5] tensor, got {list(rois.shape)}",
    )
    torch._check(ph > 0 and pw > 0, lambda: f"{op}: pooled_height and pooled_width must be positive, got {ph} and {pw}")


@torch.library.register_fake("detops::roi_align")
def _roi_align_fake(
    input: Tensor, rois: Tensor, spatial_scale: float, pooled_height: int, pooled_width: int, sampling_ratio: int, aligned: bool
) -> Tensor:
    torch._check(input.dim() == 4, lambda: f"{_OP}: input must be a [B, C, H, W] tensor, got {list(input.shape)}")
    _check_fake_common(_OP, "input", input, rois, pooled_height, pooled_width)
    torch._check(input.dtype == rois.dtype, lambda: f"{_OP}: input and rois must have the same dtype, got {input.dtype} and {rois.dtype}")
    return input.new_empty((rois.size(0), input.size(1), pooled_height, pooled_width))


@torch.library.register_fake("detops::_roi_align_backward")
def _roi_align_backward_fake(
    grad: Tensor,
    rois: Tensor,
    spatial_scale: float,
    pooled_height: int,
    pooled_width: int,
    batch_size: int,
    channels: int,
    height: int,
    width: int,
    sampling_ratio: int,
    aligned: bool,
) -> Tensor:
    op = "detops._roi_align_backward"
    _check_fake_common(op, "grad", grad, rois, pooled_height, pooled_width)
    torch._check(
        grad.dim() == 4
        and grad.size(0) == rois.size(0)
        and grad.size(1) == channels
        and grad.size(2) == pooled_height
        and grad.size(3) == pooled_width,
        lambda: f"{op}: grad must be a [K, C, PH, PW] tensor, got {list(grad.shape)}",
    )
    return grad.new_empty((batch_size, channels, height, width))


@torch.library.register_fake("detops::_to_channels_last")
def _to_channels_last_fake(input: Tensor) -> Tensor:
    # the layout in which roi_align's and roi_pool's autograd return a channels_last input's
    # gradient
    torch._check(
        input.dim() == 4,
        lambda: f"detops._to_channels_last: input must be a [B, C, H, W] tensor, got {list(input.shape)}",
    )
    return torch.empty_like(input, memory_format=torch.channels_last)
