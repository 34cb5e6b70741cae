"""Reference RoIPool (max) in plain PyTorch, written from the rules in detops.ops.roi_pool.

Geometry is computed in the kernels' arithmetic (float32 for float16 / bfloat16 / float32 data,
float64 for float64): scaled coordinates are rounded half away from zero, bins are
[floor(i * bin), ceil((i + 1) * bin)) offset by the RoI start and clamped to the map. A bin's
maximum starts from -FLT_MAX and only a strictly greater value (never NaN) replaces it, so ties
keep the first pixel in row-major order.
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

_LOWEST = -3.4028234663852886e38  # -FLT_MAX


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _round_away(v: Tensor) -> Tensor:
    t = torch.trunc(v)
    return torch.where((v - t).abs() >= 0.5, t + torch.sign(v), t)


def bins(rois: Tensor, spatial_scale: float, pooled_height: int, pooled_width: int, height: int, width: int):
    """Per RoI and bin: (h0, h1, w0, w1) as int64 tensors [K, PH] / [K, PW] (row windows depend
    only on ph, column windows only on pw)."""
    acc = _acc_dtype(rois.dtype)
    r = rois.to(acc).cpu()
    scale = torch.tensor(spatial_scale, dtype=acc)
    limit = float(1 << 30)
    c = _round_away(r[:, 1:] * scale).clamp(-limit, limit).long()  # start_w, start_h, end_w, end_h
    roi_w = (c[:, 2] - c[:, 0] + 1).clamp(min=1)
    roi_h = (c[:, 3] - c[:, 1] + 1).clamp(min=1)
    bin_h = roi_h.to(acc) / torch.tensor(float(pooled_height), dtype=acc)
    bin_w = roi_w.to(acc) / torch.tensor(float(pooled_width), dtype=acc)
    ph = torch.arange(pooled_height, dtype=acc)
    pw = torch.arange(pooled_width, dtype=acc)
    h0 = torch.floor(ph[None] * bin_h[:, None]).long() + c[:, 1:2]
    h1 = torch.ceil((ph[None] + 1) * bin_h[:, None]).long() + c[:, 1:2]
    w0 = torch.floor(pw[None] * bin_w[:, None]).long() + c[:, 0:1]
    w1 = torch.ceil((pw[None] + 1) * bin_w[:, None]).long() + c[:, 0:1]
    return h0.clamp(0, height), h1.clamp(0, height), w0.clamp(0, width), w1.clamp(0, width)


def roi_pool(
    input: Tensor, rois: Tensor, spatial_scale: float, pooled_height: int, pooled_width: int
) -> Tuple[Tensor, Tensor]:
    """input [B, C, H, W], rois [K, 5] -> (output [K, C, PH, PW] in input's dtype,
    argmax [K, C, PH, PW] int32: h * W + w of the maximum, -1 for an empty bin)."""
    k = rois.size(0)
    _, ch, height, width = input.shape
    acc = _acc_dtype(input.dtype)
    planes = input.to(torch.float64).cpu().tolist()  # exact for every supported dtype
    out = [[[[0.0] * pooled_width for _ in range(pooled_height)] for _ in range(ch)] for _ in range(k)]
    arg = [[[[-1] * pooled_width for _ in range(pooled_height)] for _ in range(ch)] for _ in range(k)]
    h0, h1, w0, w1 = (t.tolist() for t in bins(rois, spatial_scale, pooled_height, pooled_width, height, width))
    batch = rois[:, 0].cpu().long().tolist()
    for i in range(k):
        for ph in range(pooled_height):
            hs, he = h0[i][ph], h1[i][ph]
            for pw in range(pooled_width):
                ws, we = w0[i][pw], w1[i][pw]
                if he <= hs or we <= ws:
                    continue
                for c in range(ch):
                    plane = planes[batch[i]][c]
                    best, best_idx = _LOWEST, -1
                    for h in range(hs, he):
                        row = plane[h]
                        for w in range(ws, we):
                            if row[w] > best:  # strict: the first maximum wins, NaN never does
                                best, best_idx = row[w], h * width + w
                    out[i][c][ph][pw] = best
                    arg[i][c][ph][pw] = best_idx
    shape = (k, ch, pooled_height, pooled_width)
    output = torch.tensor(out, dtype=acc).view(shape).to(input.dtype).to(input.device)
    return output, torch.tensor(arg, dtype=torch.int32).view(shape).to(input.device)


def roi_pool_backward(
    grad: Tensor, rois: Tensor, argmax: Tensor, batch_size: int, channels: int, height: int, width: int
) -> Tensor:
    """grad_input [B, C, H, W]: grad_input[b, c].flatten()[argmax] += grad for argmax != -1,
    summed in float32 (float64 for float64) in RoI order."""
    acc = _acc_dtype(grad.dtype)
    gi = torch.zeros(batch_size, channels, height * width, dtype=acc)
    g = grad.to(acc).cpu()
    a = argmax.cpu().long()
    for i, b in enumerate(rois[:, 0].cpu().long().tolist()):
        for c in range(channels):
            valid = a[i, c].reshape(-1) >= 0
            gi[b, c].index_add_(0, a[i, c].reshape(-1)[valid], g[i, c].reshape(-1)[valid])
    return gi.view(batch_size, channels, height, width).to(grad.dtype).to(grad.device)
