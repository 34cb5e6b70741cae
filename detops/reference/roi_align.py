"""Reference RoIAlign in plain PyTorch, computed in float64 from the definition.

One RoI at a time, its samples vectorised: the sample grid of a RoI is the product of a set of
y coordinates and a set of x coordinates, so the border rules are applied per axis. The
backward is autograd through this function (`input.requires_grad_()` and call it).
"""
from __future__ import annotations

import math
from typing import Tuple

import torch
from torch import Tensor


def _grid(roi_size: float, pooled: int, sampling_ratio: int) -> int:
    if sampling_ratio > 0:
        return sampling_ratio
    if not math.isfinite(roi_size):
        return 0
    return max(int(math.ceil(roi_size / pooled)), 0)


def _axis(start: float, bin_size: float, pooled: int, grid: int, size: int) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Per sample along one axis (pooled * grid of them, bin-major): valid, low, high, l, h."""
    p = torch.arange(pooled, dtype=torch.float64).repeat_interleave(grid)
    i = torch.arange(grid, dtype=torch.float64).repeat(pooled)
    v = start + p * bin_size + (i + 0.5) * bin_size / grid
    valid = (v >= -1) & (v <= size) & (size > 0)
    v = v.clamp(min=0)
    low = v.floor().long()
    edge = low >= size - 1
    low = torch.where(edge, torch.full_like(low, max(size - 1, 0)), low)
    high = torch.where(edge, low, low + 1)
    v = torch.where(edge, low.double(), v)
    lw = v - low.double()
    low = low.clamp(0, max(size - 1, 0))
    high = high.clamp(0, max(size - 1, 0))
    return valid, low, high, lw, 1 - lw


def roi_align(
    input: Tensor,
    rois: Tensor,
    output_size: Tuple[int, int],
    spatial_scale: float = 1.0,
    sampling_ratio: int = -1,
    aligned: bool = False,
) -> Tensor:
    """RoIAlign of input [B, C, H, W] over rois [K, 5] -> [K, C, PH, PW], in float64.

    Differentiable with respect to input (for the reference backward)."""
    ph, pw = output_size
    x = input.double()
    r = rois.detach().double().cpu()
    _, c, h, w = x.shape
    offset = 0.5 if aligned else 0.0
    outs = []
    for k in range(r.size(0)):
        b = int(r[k, 0])
        x1, y1, x2, y2 = (float(v) * spatial_scale - offset for v in r[k, 1:])
        roi_w, roi_h = x2 - x1, y2 - y1
        if not aligned:
            roi_w, roi_h = max(roi_w, 1.0), max(roi_h, 1.0)
        bin_h, bin_w = roi_h / ph, roi_w / pw
        gh, gw = _grid(roi_h, ph, sampling_ratio), _grid(roi_w, pw, sampling_ratio)
        count = max(gh * gw, 1)
        if gh <= 0 or gw <= 0 or h == 0 or w == 0:
            outs.append(x.new_zeros((c, ph, pw)))
            continue
        vy, yl, yh, ly, hy = _axis(y1, bin_h, ph, gh, h)
        vx, xl, xh, lx, hx = _axis(x1, bin_w, pw, gw, w)
        img = x[b]
        mask = (vy[:, None] & vx[None, :]).double()

        def at(yi: Tensor, xi: Tensor) -> Tensor:
            return img[:, yi][:, :, xi]  # [C, PH*gh, PW*gw]

        val = (
            (hy[:, None] * hx[None, :]) * at(yl, xl)
            + (hy[:, None] * lx[None, :]) * at(yl, xh)
            + (ly[:, None] * hx[None, :]) * at(yh, xl)
            + (ly[:, None] * lx[None, :]) * at(yh, xh)
        ) * mask
        outs.append(val.reshape(c, ph, gh, pw, gw).sum(dim=(2, 4)) / count)
    if not outs:
        return x.new_zeros((0, c, ph, pw))
    return torch.stack(outs)
