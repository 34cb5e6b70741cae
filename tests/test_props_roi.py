"""Property-based tests (hypothesis) of the RoI ops: roi_align / RoIAlign, roi_pool / RoIPool
(forward and backward) and MultiScaleRoIAlign, on the CPU and on CUDA.

Strategies draw the batch, channels and map size (0 and 1 included, odd sizes), the RoIs (none
to several: inside, spilling over the border, outside, touching the border, huge, zero-size,
inverted (x2 < x1), identical, with non-finite coordinates), given as a [K, 5] tensor or as a
list of per-image [L, 4] boxes, output sizes 1..9 (not square), sampling ratios -1, 0 (both
adaptive) and 1..4, aligned or not, spatial scales 1 .. 1/32 and 0.3, float32 / float64 /
float16 / bfloat16, and layouts: contiguous, channels_last, channels_last at an odd offset,
strided channels, transposed H and W; RoIs contiguous, strided or transposed.

What each property holds:

* roi_align: forward and input gradient within the dtype's tolerance of the float64 reference
  (detops.reference) on the same rounded inputs, and torchvision's bits on the CPU (float32,
  float64); RoIs with a non-finite coordinate pool to exact zeros and pass no gradient (but
  x2 = -inf or y2 = -inf without `aligned`, a RoI of size 1 there by torchvision's rule); the
  module and the list-of-boxes form give the same bits; every kernel variant (CPU: layouts
  and thread counts, bit for bit; CUDA: every roi_kernel setting, NCHW and channels_last,
  atomic and deterministic backwards) is within tolerance of the reference; forwards and the
  deterministic backward repeat their bits, in one pass or in several.
* roi_pool: values and argmax bit for bit the reference's and torchvision's (ties, -0 / +0,
  NaN, +-inf and -FLT_MAX included), the values-only op the same bits; the gradient bit for bit
  the reference's (summed in RoI order) on the CPU and in the CUDA deterministic backward, and
  with the atomic backwards exact wherever a pixel gets one contribution, within the summation
  order's rounding elsewhere.
* MultiScaleRoIAlign: torchvision's MultiScaleRoIAlign within tolerance, forward and backward;
  the sync-free path (every level pools every RoI) gives the sorted path's values and
  gradients.

Float geometry (sample coordinates, the adaptive grid) is computed by the kernels in float32
for float32 / float16 / bfloat16 data, by the reference in float64. A sample whose coordinate
lies within a few float32 rounding errors of the map's border band (-1 or H, W), or an adaptive
grid within rounding of a step, can land on either side depending on the arithmetic (and on
CUDA on the contraction into fused multiply-adds): these RoIs ("fragile", found by
`fragile_rois`, which evaluates the geometry in float64 and in the kernels' type, with and
without fused multiply-adds) are left out of the value comparisons and get a zero gradient;
they still run through every kernel, and their outputs must be finite.

Kernels each selection can pick, and how these tests force each one
(csrc/cuda/roi_align.cu, roi_pool.cu: select_forward / select_backward; csrc/cpu):

| op, direction | kernel | forced here by |
|---|---|---|
| roi_align CUDA fwd | kBandSwizzled | roi_kernel("band"), contiguous NCHW float32 / float16 / bfloat16, sampling_ratio 1..4 |
| roi_align CUDA fwd | kBand | roi_kernel("band"), contiguous NCHW float64 (float32 on maps ~450+ wide: tests/test_roi_align.py) |
| roi_align CUDA fwd | kNhwc | channels_last input with C a multiple of 16 bytes (any knob but "tiled", "generic"); NCHW with C >= 32 and 8+ reads per element (C = 32 drawn, dense RoIs) |
| roi_align CUDA fwd | kTiled | roi_kernel("tiled") (any layout); the default for sparse NCHW RoIs |
| roi_align CUDA fwd | kTiled / kNhwc per-output fallback | a RoI with an adaptive grid past 512 sample rows ("giant" boxes, test_cuda_every_kernel_is_reached) |
| roi_align CUDA fwd | kGeneric | roi_kernel("generic") |
| roi_align CUDA bwd | kDeterministic | torch.use_deterministic_algorithms(True); its chunks of RoIs, slices of channels and int64 keys: _C._set_deterministic_pass_limits(max_entries, max_channels, wide_keys) |
| roi_align CUDA bwd | kBandSliced | roi_kernel("band") with float16 / bfloat16; float32 on a tall narrow map (test_cuda_every_kernel_is_reached) |
| roi_align CUDA bwd | kBandSwizzled | roi_kernel("band") with float32 |
| roi_align CUDA bwd | kBand | roi_kernel("band") with float64 |
| roi_align CUDA bwd | kTiled | roi_kernel("tiled"); the default for sparse RoIs |
| roi_align CUDA bwd | kGeneric | roi_kernel("generic") |
| roi_pool CUDA fwd | kTile | roi_kernel("band") (any layout) |
| roi_pool CUDA fwd | kChannels | channels_last input, C > 1, knob not "band" |
| roi_pool CUDA fwd | kRows | NCHW, strided or transposed input, or C == 1, knob not "band" |
| roi_pool CUDA fwd | with / without argmax | input requiring a gradient / not (_roi_pool_values) |
| roi_pool CUDA bwd | kDeterministic | torch.use_deterministic_algorithms(True) (int32 keys; int64 ones only past 2^31 gradient elements) |
| roi_pool CUDA bwd | kBand | roi_kernel("band") |
| roi_pool CUDA bwd | kAtomic | roi_kernel("gather") (also "auto" on sparse bins); float32 buffer for 16-bit dtypes; strided gradients |
| roi_align CPU fwd | NCHW / channels_last loops | layout (channels_last read in place, other strides copied to NCHW); 1 and 2 threads |
| roi_align CPU bwd | one (planes or row bands per task) | 1 and 2 threads |
| roi_pool CPU fwd | scalar / SSE2 / AVX2 / AVX-512VL masks | cpu_vector("scalar" / "sse2" / "avx2" / "avx512") with float32, C >= 8, NCHW or channels_last; other dtypes and C < 8 scalar |
| roi_pool CPU bwd | one | 1 and 2 threads |

roi_kernel("tiled") falls back to the selection's own (auto) choice where the tiled kernels
cannot take the shapes (more than 2048 bins per RoI, ...); roi_pool has neither tiled nor
generic kernels and chooses as under "auto" for those two names.
"""
import contextlib
import math
import re
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision
from hypothesis import event, example, given
from hypothesis import strategies as st

import detops
from detops.ops import MultiScaleRoIAlign, RoIAlign, RoIPool, roi_align, roi_pool
from detops.ops._utils import cpu_vector, roi_kernel
from detops.reference import roi_pool as ref_pool
from detops.reference.roi_align import roi_align as ref_roi_align
from tests.conftest import DEVICES, with_threads

ROI_KERNELS = ("auto", "band", "gather", "tiled", "generic")
CPU_VECTORS = ("auto", "scalar", "sse2", "avx2", "avx512")
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
SCALES = (1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125, 0.3)
FLT_MAX = 3.4028234663852886e38

# Unit roundoff of each output dtype, the spacing of its subnormal numbers, and the
# accumulation type of each dtype.
OUT_EPS = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
OUT_TINY = {t: torch.finfo(t).smallest_normal * torch.finfo(t).eps for t in OUT_EPS}
ACC = {torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float32, torch.bfloat16: np.float32}


def bits(t):
    """t's bits as integers of the same size: equal bits, zero signs included."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@contextlib.contextmanager
def deterministic_algorithms(on):
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(on)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


@contextlib.contextmanager
def pass_limits(max_entries=0, max_channels=0, wide_keys=False):
    previous = detops._C._set_deterministic_pass_limits(max_entries, max_channels, wide_keys)
    try:
        yield
    finally:
        detops._C._set_deterministic_pass_limits(*previous)


# --- strategies ---------------------------------------------------------------------------------


def _coord(lo, hi):
    """A coordinate in [lo, hi]: an integer, a half, or any float32."""
    lo32, hi32 = float(np.float32(lo)), float(np.float32(hi))
    options = [st.floats(min(lo32, hi32), max(lo32, hi32), allow_nan=False, allow_infinity=False, width=32)]
    if math.ceil(lo) <= math.floor(hi):
        options.append(st.integers(math.ceil(lo), math.floor(hi)).map(float))
    if math.ceil(2 * lo) <= math.floor(2 * hi):
        options.append(st.integers(math.ceil(2 * lo), math.floor(2 * hi)).map(lambda v: v / 2))
    return st.one_of(options[::-1])


BOX_KINDS = (
    "inside", "spill", "outside", "touching", "whole", "huge", "zero_size", "point", "inverted",
    "identical", "tiny", "nonfinite", "giant",
)


@st.composite
def feature_box(draw, height, width, max_side, previous, allow_nonfinite=True):
    """(x1, y1, x2, y2) in feature-map pixels on an H x W map. max_side bounds huge RoIs
    (adaptive sampling grids grow with the RoI); "giant" boxes (rare) pass 512 sample rows."""
    kinds = [k for k in BOX_KINDS if (allow_nonfinite or k != "nonfinite") and (previous or k != "identical")]
    kind = draw(st.sampled_from(kinds))
    h, w = max(height, 1), max(width, 1)
    if kind == "identical":
        return draw(st.sampled_from(previous))
    if kind == "inside":
        x1, y1 = draw(_coord(0, w)), draw(_coord(0, h))
        return (x1, y1, draw(_coord(x1, w)), draw(_coord(y1, h)))
    if kind == "spill":
        x1, y1 = draw(_coord(-w, w)), draw(_coord(-h, h))
        return (x1, y1, x1 + draw(_coord(0, 2 * w)), y1 + draw(_coord(0, 2 * h)))
    if kind == "outside":
        side = draw(st.sampled_from(["left", "right", "above", "below"]))
        a, b = draw(_coord(1.5, 3 * w + 3)), draw(_coord(1.5, 3 * h + 3))
        return {"left": (-a - 3, 0.0, -a, h), "right": (w + a, 1.0, w + a + 2, 2.0),
                "above": (0.0, -b - 4, w, -b), "below": (1.0, h + b, 3.0, h + b + 1)}[side]
    if kind == "touching":
        # edges on the map's border, on the border band (-1, H, W) and half a pixel off
        e = draw(st.sampled_from([-1.5, -1.0, -0.5, 0.0, 0.5]))
        return (e, e, w - e, h - e) if draw(st.booleans()) else (w - 1 - e, h - 1 - e, w + e + 1, h + e + 1)
    if kind == "whole":
        return (0.0, 0.0, float(w), float(h))
    if kind == "huge":
        m = max_side / 2
        return (-draw(_coord(0, m)), -draw(_coord(0, m)), w + draw(_coord(0, m)), h + draw(_coord(0, m)))
    if kind == "zero_size":
        x, y = draw(_coord(-1, w)), draw(_coord(-1, h))
        return (x, y, x, draw(_coord(y, h))) if draw(st.booleans()) else (x, y, draw(_coord(x, w)), y)
    if kind == "point":
        x, y = draw(_coord(-1, w)), draw(_coord(-1, h))
        return (x, y, x, y)
    if kind == "inverted":
        x1, y1 = draw(_coord(0, w)), draw(_coord(0, h))
        return (x1, y1, x1 - draw(_coord(0, w)), y1 - draw(_coord(0, h)))
    if kind == "tiny":
        x, y = draw(_coord(0, w)), draw(_coord(0, h))
        d = draw(st.sampled_from([1e-3, 0.125, 0.3]))
        return (x, y, x + d, y + d)
    if kind == "nonfinite":
        bad = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
        box = [1.0, 1.0, w - 1.0, h - 1.0]
        box[draw(st.integers(0, 3))] = bad
        return tuple(box)
    # giant: an adaptive grid of more than 512 sample rows at one bin per RoI side
    side = draw(st.integers(520, 560))
    return (-side / 2, -side / 2, side / 2, side / 2)


@st.composite
def roi_sets(draw, batch, height, width, scale, max_side, max_rois=7, allow_nonfinite=True, allow_giant=False):
    """RoIs as float64 [K, 5] rows (batch index, x1, y1, x2, y2) in image coordinates; K = 0
    when there are no images."""
    k = draw(st.integers(0, max_rois)) if batch > 0 else 0
    boxes = []
    for _ in range(k):
        box = draw(feature_box(height, width, max_side, boxes, allow_nonfinite))
        if not allow_giant and abs(box[2] - box[0]) > max_side + max(width, 1) + 2:
            box = (0.0, 0.0, 1.0, 1.0)
        boxes.append(box)
    index = [draw(st.integers(0, batch - 1)) for _ in range(k)]
    rows = [[float(b)] + [c / scale for c in box] for b, box in zip(index, boxes)]
    return torch.tensor(rows, dtype=torch.float64).reshape(k, 5)


INPUT_LAYOUTS = ("contiguous", "channels_last", "channels_last_offset", "channel_stride", "hw_transposed")
ROI_LAYOUTS = ("contiguous", "column_stride", "transposed")


@st.composite
def roi_align_cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    batch = draw(st.integers(0, 3))
    channels = draw(st.sampled_from([0, 1, 2, 3, 5, 8, 32]))
    height, width = draw(st.integers(0, 17)), draw(st.integers(0, 17))
    scale = draw(st.sampled_from(SCALES))
    sampling_ratio = draw(st.sampled_from([-1, 0, 1, 2, 3, 4]))
    # adaptive grids grow with the RoI: bound the side so that the reference stays cheap
    max_side = 48 if sampling_ratio <= 0 else 4000
    rois = draw(roi_sets(batch, height, width, scale, max_side, allow_giant=sampling_ratio <= 0 and channels <= 3))
    return dict(
        dtype=dtype, batch=batch, channels=channels, height=height, width=width, scale=scale,
        sampling_ratio=sampling_ratio, aligned=draw(st.booleans()),
        output_size=(draw(st.integers(1, 9)), draw(st.integers(1, 9))),
        rois=rois, roi_layout=draw(st.sampled_from(ROI_LAYOUTS)), as_list=draw(st.booleans()),
        layout=draw(st.sampled_from(INPUT_LAYOUTS)), values=draw(st.sampled_from(["normal", "integers", "large"])),
        seed=draw(st.integers(0, 2**31 - 1)),
        limits=draw(st.sampled_from([(0, 0, False), (0, 1, False), (0, 0, True), (2000, 0, False), (2000, 2, True)])),
    )


@st.composite
def roi_pool_cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    batch = draw(st.integers(0, 3))
    channels = draw(st.sampled_from([0, 1, 2, 3, 8, 9, 16]))
    height, width = draw(st.integers(0, 15)), draw(st.integers(0, 15))
    scale = draw(st.sampled_from(SCALES))
    rois = draw(roi_sets(batch, height, width, scale, 1e5))
    if dtype in (torch.float16, torch.bfloat16):
        rois = rois.clamp(-6e4, 6e4)  # within float16's range; +-inf stays
    return dict(
        dtype=dtype, batch=batch, channels=channels, height=height, width=width, scale=scale,
        output_size=(draw(st.integers(1, 9)), draw(st.integers(1, 9))),
        rois=rois, roi_layout=draw(st.sampled_from(ROI_LAYOUTS)), as_list=draw(st.booleans()),
        layout=draw(st.sampled_from(INPUT_LAYOUTS)),
        values=draw(st.sampled_from(["normal", "ties", "signed_zeros", "special"])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


# --- inputs from a case ---------------------------------------------------------------------------


def feature_values(shape, kind, seed, dtype):
    """A [B, C, H, W] map of `kind` values, rounded to dtype (float64 holds them exactly)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    if kind == "large":
        x = x * 1000
    elif kind in ("integers", "ties"):
        x = torch.randint(-2, 3, shape, generator=g).double()
    elif kind == "signed_zeros":
        x = torch.randint(-1, 2, shape, generator=g).double()
        x = torch.where((x == 0) & (torch.rand(shape, generator=g) < 0.5), -0.0, x)
    elif kind == "special":
        special = torch.tensor([math.nan, math.inf, -math.inf, -FLT_MAX, -0.0], dtype=torch.float64)
        pick = torch.randint(0, 5, shape, generator=g)
        x = torch.where(torch.rand(shape, generator=g) < 0.2, special[pick], x)
    return x.to(dtype)


def with_layout(x, layout):
    """x (a contiguous [B, C, H, W] tensor) stored in `layout`, as a leaf of the same values."""
    b, c, h, w = x.shape
    if layout == "channels_last":
        y = x.contiguous(memory_format=torch.channels_last)
    elif layout == "channels_last_offset":
        # a channels_last map one row further into its storage (not 16-byte aligned for
        # most sizes), and for B > 1 not channels_last contiguous
        big = torch.zeros(b, c, h + 1, w, dtype=x.dtype, device=x.device).contiguous(memory_format=torch.channels_last)
        big[:, :, 1:] = x
        y = big[:, :, 1:]
    elif layout == "channel_stride":
        big = torch.zeros(b, 2 * c, h, w, dtype=x.dtype, device=x.device)
        big[:, ::2] = x
        y = big[:, ::2]
    elif layout == "hw_transposed":
        y = x.transpose(2, 3).contiguous().transpose(2, 3)
    else:
        y = x.clone()
    assert torch.equal(bits(y), bits(x))
    return y.detach()


def rois_with_layout(rois, layout):
    k = rois.size(0)
    if layout == "column_stride":
        big = torch.zeros(k, 10, dtype=rois.dtype, device=rois.device)
        big[:, ::2] = rois
        return big[:, ::2]
    if layout == "transposed":
        return rois.t().contiguous().t()
    return rois.clone()


def as_boxes(rois, batch):
    """The list-of-boxes form of rois (sorted by image): one [L, 4] tensor per image."""
    return [rois[rois[:, 0] == b, 1:] for b in range(batch)]


def sorted_by_image(rois):
    if rois.size(0) == 0:
        return rois
    order = torch.sort(rois[:, 0].double(), stable=True).indices
    return rois[order]


def finite_rows(rois):
    return torch.isfinite(rois.double()).all(1) if rois.numel() else torch.ones(rois.size(0), dtype=torch.bool)


def align_equivalent(rois, aligned):
    """RoIs with the geometry roi_align gives rois, finite where it can be: without `aligned` a
    RoI is at least 1 x 1, so x2 = -inf (y2 = -inf) pools as x2 = x1 (y2 = y1) does. The rows
    still not finite (any NaN, other infinities) pool to zeros and pass no gradient."""
    r = rois.detach().clone()
    if not aligned and r.numel():
        for end, start in ((3, 1), (4, 2)):
            r[:, end] = torch.where(r[:, end] == -math.inf, r[:, start], r[:, end])
    return r


# --- roi_align geometry: which RoIs sit on a rounding edge ------------------------------------


def _round(v, t):
    return float(t(float(v)))


def _axis_geometry(c1, c2, scale, offset, pooled, sampling_ratio, aligned, acc, variant):
    """(start, end, bin, grid, q) of one axis of a RoI in one arithmetic: "f64" (the
    reference), "plain" (the kernels' type, one rounding per operation) or "fma" (the kernels'
    type with products fused into the following addition)."""
    if variant == "f64":
        start, end = c1 * scale - offset, c2 * scale - offset
        rnd = float
    else:
        s = _round(scale, acc)
        if variant == "plain":
            start = _round(_round(_round(c1, acc) * s, acc) - offset, acc)
            end = _round(_round(_round(c2, acc) * s, acc) - offset, acc)
        else:
            start = _round(Fraction(_round(c1, acc)) * Fraction(s) - Fraction(offset), acc)
            end = _round(Fraction(_round(c2, acc)) * Fraction(s) - Fraction(offset), acc)

        def rnd(v):
            return _round(v, acc)

    size = rnd(end - start)
    if not aligned:
        size = max(size, 1.0)
    binsize = rnd(size / pooled)
    q = binsize if variant == "f64" else rnd(size / pooled)
    if sampling_ratio > 0:
        grid = sampling_ratio
    else:
        v = math.ceil(q) if math.isfinite(q) else q
        grid = int(v) if (isinstance(v, int) or math.isfinite(v)) and v > 0 else 0
    return start, end, binsize, grid, q


def _samples(start, binsize, pooled, grid, acc, variant):
    out = []
    for p in range(pooled):
        for i in range(grid):
            if variant == "f64":
                out.append(start + p * binsize + (i + 0.5) * binsize / grid)
            elif variant == "plain":
                t1 = _round(start + _round(p * binsize, acc), acc)
                t2 = _round(_round((i + 0.5) * binsize, acc) / grid, acc)
                out.append(_round(t1 + t2, acc))
            else:
                t1 = _round(Fraction(start) + p * Fraction(binsize), acc)
                t2 = _round(_round((i + 0.5) * binsize, acc) / grid, acc)
                out.append(_round(t1 + t2, acc))
    return out


def fragile_rois(rois, dtype, scale, output_size, sampling_ratio, aligned, height, width):
    """Bool [K]: RoIs whose samples or adaptive grid lie within rounding of an edge (see the
    module docstring), and RoIs with a non-finite coordinate. Also returns, per RoI, its
    samples per bin (max(grid_h * grid_w, 1)) and the magnitude of its coordinates on the map
    (the scale of its float32 rounding errors)."""
    acc = ACC[dtype]
    eps = float(np.finfo(acc).eps)
    offset = 0.5 if aligned else 0.0
    r = rois.detach().double().cpu()
    k = r.size(0)
    fragile = torch.zeros(k, dtype=torch.bool)
    count = torch.ones(k, dtype=torch.float64)
    magnitude = torch.ones(k, dtype=torch.float64)
    for j in range(k):
        row = r[j].tolist()
        if not all(math.isfinite(v) for v in row):
            fragile[j] = True
            continue
        grids = []
        for c1, c2, pooled, size in ((row[1], row[3], output_size[1], width), (row[2], row[4], output_size[0], height)):
            geo = {v: _axis_geometry(c1, c2, scale, offset, pooled, sampling_ratio, aligned, acc, v)
                   for v in ("f64", "plain", "fma")}
            start, end, binsize, grid, q = geo["f64"]
            magnitude[j] = max(magnitude[j].item(), abs(start), abs(end), abs(binsize) * pooled, 1.0)
            grids.append(grid)
            if len({g[3] for g in geo.values()}) > 1:
                fragile[j] = True
                break
            if sampling_ratio <= 0 and len({g[4] for g in geo.values()}) > 1:
                margin = 16 * eps * (abs(start) + abs(end) + 1) / pooled
                if abs(q - round(q)) <= margin:
                    fragile[j] = True
                    break
            if size <= 0 or grid == 0:
                continue
            samples = {v: _samples(g[0], g[2], pooled, g[3], acc, v) for v, g in geo.items()}
            for n, v64 in enumerate(samples["f64"]):
                vs = [samples[v][n] for v in ("f64", "plain", "fma")]
                inside = {(-1 <= v <= size) for v in vs}
                if len(inside) > 1:
                    fragile[j] = True
                    break
                if len(set(vs)) > 1:
                    margin = 16 * eps * (abs(start) + abs(binsize) * pooled + 1)
                    if min(abs(v64 + 1), abs(v64 - size)) <= margin:
                        fragile[j] = True
                        break
            if fragile[j]:
                break
        if len(grids) == 2:
            count[j] = max(grids[0] * grids[1], 1)
    return fragile, count, magnitude


def box_sum3(t):
    """Each pixel's sum over its 3 x 3 neighbourhood, [B, C, H, W]."""
    if t.numel() == 0:
        return t
    h, w = t.shape[-2:]
    p = F.pad(t, (1, 1, 1, 1))
    return sum(p[..., i : i + h, j : j + w] for i in range(3) for j in range(3))


class AlignOracle:
    """The float64 reference's forward and input gradient on the rounded inputs, with the
    tolerances the kernels must meet (see assert_forward, assert_grad)."""

    def __init__(self, x, rois, case, grad):
        self.dtype = case["dtype"]
        self.acc_eps = float(np.finfo(ACC[self.dtype]).eps)
        self.out_eps = OUT_EPS[self.dtype]
        rois = align_equivalent(rois, case["aligned"])
        self.dead = ~finite_rows(rois).cpu()
        self.fragile, count, magnitude = fragile_rois(
            rois, self.dtype, case["scale"], case["output_size"], case["sampling_ratio"], case["aligned"],
            case["height"], case["width"])
        self.stable = ~self.fragile
        self.fragile &= ~self.dead
        x64 = x.detach().cpu().double().contiguous().requires_grad_()
        r64 = rois.detach().cpu().double()
        keep = self.stable
        out = ref_roi_align(x64, r64[keep], case["output_size"], case["scale"], case["sampling_ratio"], case["aligned"])
        self.out = torch.zeros((rois.size(0),) + tuple(out.shape[1:]), dtype=torch.float64)
        self.out[keep] = out.detach()
        g64 = grad.detach().cpu().double()[keep]
        # error of a sample coordinate on the map: a few roundings of the RoI's coordinates
        self.coord_err = 16 * self.acc_eps * (magnitude + 1)
        self.count = count
        # the reference's gradient, and gradients of |grad| (the magnitude that reaches each
        # pixel), of |grad| times the RoI's coordinate error, and of each RoI's sample count
        # (how many terms a pixel sums)
        self.grad = self.grad_abs = self.grad_coord = self.grad_count = torch.zeros_like(x64)
        if out.requires_grad:
            per_roi = count[keep].view(-1, 1, 1, 1).expand_as(out)
            coord = self.coord_err[keep].view(-1, 1, 1, 1)
            self.grad, self.grad_abs, self.grad_coord, self.grad_count = (
                torch.autograd.grad(out, x64, gv, retain_graph=True)[0]
                for gv in (g64, g64.abs(), g64.abs() * coord, per_roi)
            )
        self.max_x = x64.detach().abs().max().item() if x64.numel() else 0.0
        self._reach = None

    def assert_forward(self, got, what, want=None):
        """got [K, C, PH, PW] (any device) within tolerance of the reference on the stable RoIs,
        and finite on all; or within twice the tolerance of `want`, another result within it."""
        got = got.detach().cpu().double()
        slack = 1 if want is None else 2
        want = self.out if want is None else want.detach().cpu().double()
        assert torch.isfinite(got).all(), what
        k = self.stable
        if not k.any() or got.numel() == 0:
            return
        per_roi = (2 * self.coord_err + (self.count + 8) * self.acc_eps) * self.max_x
        tol = slack * (per_roi[k].view(-1, 1, 1, 1) + 2 * self.out_eps * self.out[k].abs() + OUT_TINY[self.dtype])
        err = (got[k] - want[k]).abs()
        bad = err > tol
        assert not bad.any(), f"{what}: forward off by {err[bad].max().item():.3g} (tolerance {tol[bad].min().item():.3g})"

    def assert_grad(self, got, what, want=None):
        """got [B, C, H, W] within tolerance of the reference's input gradient (or within twice
        it of `want`): the sample coordinates' rounding times the gradient that reaches a
        pixel's neighbourhood, plus the summation's rounding (each pixel's contributions at
        most grad_count's neighbourhood sum of them)."""
        got = got.detach().cpu().double()
        slack = 1 if want is None else 2
        want = self.grad if want is None else want.detach().cpu().double()
        assert torch.isfinite(got).all(), what
        if got.numel() == 0:
            return
        if self._reach is None:
            # a sample reads pixels of its 3 x 3 neighbourhood: sums over it bound what reaches
            # a pixel through samples that touch it
            self._reach = [box_sum3(t) for t in (self.grad_abs, self.grad_coord, self.grad_count)]
        reach, coord_reach, terms = self._reach
        tol = slack * (2 * coord_reach + 2 * (terms + 4) * self.acc_eps * reach + 2 * self.out_eps * self.grad.abs() +
                       OUT_TINY[self.dtype])
        err = (got - want).abs()
        bad = err > tol
        assert not bad.any(), f"{what}: gradient off by {err[bad].max().item():.3g} (tolerance {tol[bad].min().item():.3g})"


def roi_inputs(case, device, sparse_grad=False):
    """The map, the RoIs (a list of per-image boxes when the case says so) and an output gradient
    for a drawn roi_align / roi_pool case; with sparse_grad, some RoIs get no gradient."""
    dtype = case["dtype"]
    shape = (case["batch"], case["channels"], case["height"], case["width"])
    x = feature_values(shape, case["values"], case["seed"], dtype).to(device)
    rois = case["rois"].to(dtype).to(device)
    if case["as_list"]:
        rois = sorted_by_image(rois)
    g = torch.Generator().manual_seed(case["seed"] + 1)
    grad = torch.randn((rois.size(0), case["channels"]) + tuple(case["output_size"]), generator=g, dtype=torch.float64)
    if sparse_grad and grad.size(0) > 1:
        grad[:: max(2, grad.size(0) // 2)] = 0  # RoIs without gradient add nothing
    return x, rois, grad.to(dtype)


def align_inputs(case, device):
    return roi_inputs(case, device, sparse_grad=True)


def run_roi_align(x, boxes, case, grad, layout=None):
    """(output, input gradient) of roi_align on x stored in `layout`."""
    xi = with_layout(x, layout or case["layout"]).requires_grad_()
    out = roi_align(xi, boxes, case["output_size"], case["scale"], case["sampling_ratio"], case["aligned"])
    (gi,) = torch.autograd.grad(out, xi, grad.to(out.device)) if out.numel() else (torch.zeros_like(xi),)
    return out.detach(), gi


# --- roi_align ------------------------------------------------------------------------------------


def _align_example(**kw):
    case = dict(dtype=torch.float32, batch=1, channels=1, height=2, width=2, scale=1.0, sampling_ratio=-1,
                aligned=False, output_size=(1, 1), roi_layout="contiguous", as_list=False, layout="contiguous",
                values="normal", seed=0, limits=(0, 0, False))
    case.update(kw)
    case["rois"] = torch.tensor(case["rois"], dtype=torch.float64).reshape(-1, 5)
    return example(case=case)


@pytest.mark.parametrize("device", DEVICES)
@given(case=roi_align_cases())
# an empty map with RoIs (torchvision reads outside it; detops pools zeros)
@_align_example(height=0, width=0, rois=[[0, 0.0, 0.0, 0.0, 0.0]])
# x2 = -inf without `aligned`: a 1 x 1 RoI at x1, as torchvision's rule makes it
@_align_example(rois=[[0, 1.0, 1.0, -math.inf, 1.0]])
@_align_example(rois=[[0, math.nan, 1.0, 0.0, 0.0], [0, 0.0, 0.0, 2.0, 2.0]], channels=0, height=0, width=0)
# an adaptive grid past 512 sample rows: the tiled kernels' per-output fallback
@_align_example(rois=[[0, -270.0, -265.0, 270.0, 275.0], [0, 0.5, 0.5, 1.5, 1.5]], height=5, width=7, channels=2)
# float16: a gradient in float16's subnormal range (rounded to its absolute spacing)
@_align_example(dtype=torch.float16, height=1, width=1, rois=[[0, 0.0, 0.0, 0.0, 0.0], [0, -260.0, -260.0, 260.0, 260.0]])
def test_roi_align_properties(device, case):
    """roi_align against the reference and torchvision, forward and backward, in every layout and
    with every kernel variant; see the module docstring."""
    dtype, batch = case["dtype"], case["batch"]
    x, rois, grad = align_inputs(case, device)
    oracle = AlignOracle(x, rois, case, grad)
    grad[oracle.fragile] = 0  # rounding-edge RoIs get no gradient, so every pixel can be compared
    event(f"fragile RoIs: {int(oracle.fragile.sum())}")
    event(f"non-finite RoIs: {int(oracle.dead.sum())}")
    rois_in = rois_with_layout(rois, case["roi_layout"])
    boxes = as_boxes(rois_in, batch) if case["as_list"] and batch > 0 else rois_in
    size, scale, sr, aligned = case["output_size"], case["scale"], case["sampling_ratio"], case["aligned"]

    out, gi = run_roi_align(x, boxes, case, grad)
    assert out.shape == (rois.size(0), case["channels"]) + tuple(size)
    assert out.dtype == dtype and out.is_contiguous() and out.device == x.device
    assert gi.shape == x.shape and gi.dtype == dtype
    oracle.assert_forward(out, "default kernels")
    oracle.assert_grad(gi, "default kernels")
    # RoIs with a non-finite coordinate (but the 1 x 1 ones, align_equivalent) read nothing;
    # their gradient is not zeroed, and the comparison of gi with the reference (which has
    # none of it) checks that they pass none
    if out.numel() and oracle.dead.any():
        assert out[oracle.dead.to(out.device)].abs().max() == 0
    # the module, the [K, 5] form and a repeated call give the same bits
    module = RoIAlign(size, scale, sr, aligned)
    assert torch.equal(bits(module(x, boxes)), bits(out))
    assert torch.equal(bits(roi_align(x, rois, size, scale, sr, aligned)), bits(out))

    # (torchvision reads outside an empty map: no comparison there)
    if dtype in (torch.float32, torch.float64) and case["height"] > 0 and case["width"] > 0:
        xt = x.detach().cpu().requires_grad_()
        keep = ~oracle.dead
        tv = torchvision.ops.roi_align(xt, align_equivalent(rois, aligned).cpu()[keep], size, scale, sr, aligned)
        if tv.numel():
            (gt,) = torch.autograd.grad(tv, xt, grad.cpu()[keep])
            if device == "cpu":
                # the arithmetic of torchvision's CPU kernel: the same bits forward
                assert torch.equal(bits(out[keep]), bits(tv)), "forward differs from torchvision"
            tv_all = torch.zeros(out.shape, dtype=dtype)
            tv_all[keep] = tv.detach()
            oracle.assert_forward(out, "against torchvision", want=tv_all)
            oracle.assert_grad(gi, "against torchvision's gradient", want=gt)

    if device == "cpu":
        # NCHW and channels_last loops, 1 and 2 threads: the same bits forward and backward
        for layout in ("contiguous", "channels_last"):
            for threads in (1, 2):
                o, g = with_threads(threads, lambda: run_roi_align(x, rois, case, grad, layout))
                assert torch.equal(bits(o), bits(out)), (layout, threads)
                assert torch.equal(bits(g.contiguous()), bits(gi.contiguous())), (layout, threads)
        return

    # CUDA: every kernel the selection can be forced to, NCHW and channels_last
    for kernel in ROI_KERNELS:
        for layout in ("contiguous", "channels_last"):
            with roi_kernel(kernel):
                o, g = run_roi_align(x, rois, case, grad, layout)
                again = roi_align(with_layout(x, layout), rois, size, scale, sr, aligned)
            what = f"roi_kernel({kernel!r}), {layout}"
            assert torch.equal(bits(again), bits(o)), what  # forwards repeat their bits
            oracle.assert_forward(o, what)
            oracle.assert_grad(g, what)
    # the deterministic backward: bit-identical from run to run, in one pass or several
    with deterministic_algorithms(True):
        _, det = run_roi_align(x, rois, case, grad, "contiguous")
        _, det2 = run_roi_align(x, rois, case, grad, "channels_last")
        assert torch.equal(bits(det2.contiguous()), bits(det))
        oracle.assert_grad(det, "deterministic backward")
        max_entries, max_channels, wide_keys = case["limits"]
        try:
            with pass_limits(max_entries, max_channels, wide_keys):
                _, passes = run_roi_align(x, rois, case, grad, "contiguous")
                _, passes2 = run_roi_align(x, rois, case, grad, "contiguous")
        except RuntimeError as e:
            # a RoI with more contributions than max_entries is refused, naming the limit
            assert max_entries and "contributions" in str(e), e
        else:
            assert torch.equal(bits(passes), bits(passes2))
            if max_entries == 0:
                assert torch.equal(bits(passes), bits(det))  # slices of channels, int64 keys
            oracle.assert_grad(passes, f"deterministic backward, pass limits {case['limits']}")


# --- roi_pool -------------------------------------------------------------------------------------


def pool_inputs(case, device):
    return roi_inputs(case, device)


def pool_reference(x, rois, case, grad):
    """The reference's (output, argmax, grad_input) on the CPU. RoIs with a NaN coordinate
    have only empty bins (output 0, argmax -1); the reference takes the others."""
    ph, pw = case["output_size"]
    xc, rc = x.detach().cpu(), rois.detach().cpu()
    nan_rows = torch.isnan(rc.double()).any(1) if rc.numel() else torch.zeros(0, dtype=torch.bool)
    out = torch.zeros((rc.size(0), xc.size(1), ph, pw), dtype=xc.dtype)
    arg = torch.full(out.shape, -1, dtype=torch.int32)
    if (~nan_rows).any():
        o, a = ref_pool.roi_pool(xc.contiguous(), rc[~nan_rows], case["scale"], ph, pw)
        out[~nan_rows], arg[~nan_rows] = o, a
    gi = ref_pool.roi_pool_backward(grad.cpu(), rc, arg, *xc.shape)
    return out, arg, gi


@pytest.mark.parametrize("device", DEVICES)
@given(case=roi_pool_cases())
def test_roi_pool_properties(device, case):
    """roi_pool against the reference and torchvision: values (the values-only op too) and
    argmax bit for bit; gradients bit for bit where the summation order is the reference's,
    within its rounding elsewhere; every kernel variant; see the module docstring."""
    dtype, batch = case["dtype"], case["batch"]
    x, rois, grad = pool_inputs(case, device)
    size, scale = case["output_size"], case["scale"]
    ph, pw = size
    want, want_arg, want_gi = pool_reference(x, rois, case, grad)
    event(f"values: {case['values']}")
    rois_in = rois_with_layout(rois, case["roi_layout"])
    boxes = as_boxes(rois_in, batch) if case["as_list"] and batch > 0 else rois_in

    def run(layout, boxes=boxes):
        xi = with_layout(x, layout).requires_grad_()
        out = roi_pool(xi, boxes, size, scale)
        (gi,) = torch.autograd.grad(out, xi, grad.to(out.device)) if out.numel() else (torch.zeros_like(xi),)
        values = roi_pool(xi.detach(), boxes, size, scale)  # no gradient: the kernels skip argmax
        full, arg = torch.ops.detops.roi_pool(xi.detach(), rois_in, scale, ph, pw)
        return out.detach(), gi, values, full, arg

    out, gi, values, full, arg = run(case["layout"])
    assert out.shape == want.shape and out.dtype == dtype and out.is_contiguous()
    assert arg.dtype == torch.int32 and gi.shape == x.shape and gi.dtype == dtype
    for o in (out, values, full):
        assert torch.equal(bits(o.cpu()), bits(want)), "values differ from the reference"
    assert torch.equal(arg.cpu(), want_arg), "argmax differs from the reference"
    assert torch.equal(bits(RoIPool(size, scale)(x, boxes).cpu()), bits(want))

    if dtype in (torch.float32, torch.float64) and x.numel() and rois.numel():
        ok = finite_rows(rois.cpu())  # torchvision converts infinities to int: undefined
        tv_out, tv_arg = torch.ops.torchvision.roi_pool(x.cpu(), rois.cpu()[ok], scale, ph, pw)
        assert torch.equal(bits(out.cpu()[ok]), bits(tv_out)), "values differ from torchvision"
        assert torch.equal(arg.cpu()[ok], tv_arg.int()), "argmax differs from torchvision"

    # grad_input: the reference's sums (in RoI order) exactly where the order is the same
    contributions = torch.zeros(x.shape, dtype=torch.float64).flatten(2)
    mass = torch.zeros(x.shape, dtype=torch.float64).flatten(2)
    if want_arg.numel():
        flat = want_arg.flatten(2).long()
        for k, b in enumerate(rois.cpu()[:, 0].double().tolist()):
            valid = flat[k] >= 0
            if valid.any() and 0 <= b < batch:
                b = int(b)
                for c in range(x.size(1)):
                    idx = flat[k, c][valid[c]]
                    contributions[b, c].index_add_(0, idx, torch.ones(idx.numel(), dtype=torch.float64))
                    mass[b, c].index_add_(0, idx, grad.cpu()[k, c].flatten()[valid[c]].double().abs())
    contributions, mass = contributions.view(x.shape), mass.view(x.shape)
    acc_eps = float(np.finfo(ACC[dtype]).eps)
    # an unordered sum of n terms: within 2 n eps of their magnitude, then the output's rounding
    order_tol = 2 * contributions * acc_eps * mass + 2 * OUT_EPS[dtype] * want_gi.double().abs() + OUT_TINY[dtype]

    def assert_grad(got, what, exact):
        got = got.detach().cpu()
        if exact:
            assert torch.equal(bits(got.contiguous()), bits(want_gi)), f"{what}: gradient differs from the reference"
            return
        single = contributions <= 1
        assert torch.equal(bits(got[single].contiguous()), bits(want_gi[single])), f"{what}: single contributions"
        err = (got.double() - want_gi.double()).abs()
        assert not (err > order_tol).any(), f"{what}: gradient off by {err.max().item():.3g}"

    assert_grad(gi, "default kernels", exact=device == "cpu")
    if dtype in (torch.float32, torch.float64) and x.numel() and rois.numel():
        # torchvision adds in RoI order too: its gradient has the reference's bits
        xt = x.detach().cpu().requires_grad_()
        ok = finite_rows(rois.cpu())
        tv = torchvision.ops.roi_pool(xt, rois.cpu()[ok], size, scale)
        if tv.numel():
            (gt,) = torch.autograd.grad(tv, xt, grad.cpu()[ok])
            want_ok = ref_pool.roi_pool_backward(grad.cpu()[ok], rois.cpu()[ok], want_arg[ok], *x.shape)
            assert torch.equal(bits(gt), bits(want_ok)), "torchvision's gradient differs from the reference"

    if device == "cpu":
        # every instruction set, NCHW and channels_last, 1 and 2 threads: the same bits
        for vector in CPU_VECTORS:
            for layout in ("contiguous", "channels_last"):
                for threads in (1, 2):
                    with cpu_vector(vector):
                        o, g, v, f, a = with_threads(threads, lambda: run(layout))
                    what = (vector, layout, threads)
                    for t in (o, v, f):
                        assert torch.equal(bits(t), bits(want)), what
                    assert torch.equal(a, want_arg), what
                    assert torch.equal(bits(g.contiguous()), bits(want_gi)), what
        return

    # CUDA: every kernel, NCHW and channels_last, atomic and deterministic backwards
    for kernel in ROI_KERNELS:
        for layout in ("contiguous", "channels_last", "hw_transposed"):
            with roi_kernel(kernel):
                o, g, v, f, a = run(layout)
                what = f"roi_kernel({kernel!r}), {layout}"
                for t in (o, v, f):
                    assert torch.equal(bits(t.cpu()), bits(want)), what
                assert torch.equal(a.cpu(), want_arg), what
                assert_grad(g, what, exact=False)
                with deterministic_algorithms(True):
                    _, g1, *_ = run(layout)
                    _, g2, *_ = run(layout)
                assert_grad(g1, what + ", deterministic", exact=True)
                assert torch.equal(bits(g1.contiguous()), bits(g2.contiguous()))
                # a strided gradient (the atomic kernel's strided variant)
                if full.numel():
                    gs = torch.ops.detops._roi_pool_backward(
                        grad.to(device).transpose(2, 3).contiguous().transpose(2, 3), rois, a, scale, ph, pw, *x.shape)
                    assert_grad(gs, what + ", strided gradient", exact=False)


# --- MultiScaleRoIAlign ---------------------------------------------------------------------------


@st.composite
def multiscale_cases(draw):
    k_min = draw(st.integers(2, 3))
    levels = draw(st.integers(1, 4))
    k_max = k_min + levels - 1
    stride_max = 2**k_max
    image = (stride_max * draw(st.integers(1, 3)), stride_max * draw(st.integers(1, 3)))
    batch = draw(st.integers(1, 3))
    # the first image is the largest, which fixes the maps' scales; the others may be smaller
    shapes = [image] + [(draw(st.integers(min(8, image[0]), image[0])), draw(st.integers(min(8, image[1]), image[1])))
                        for _ in range(batch - 1)]
    sampling_ratio = draw(st.sampled_from([-1, 0, 1, 2, 3]))
    max_side = 300 if sampling_ratio <= 0 else 3000
    boxes = []
    for h, w in shapes:
        n = draw(st.integers(0, 5))
        per_image = []
        for _ in range(n):
            if draw(st.booleans()):
                # a spread of sizes, so that every level gets boxes
                side = 2 ** draw(st.floats(0, math.log2(max_side)))
                cx, cy = draw(_coord(-8, w + 8)), draw(_coord(-8, h + 8))
                aspect = draw(st.sampled_from([0.5, 1.0, 2.0]))
                per_image.append((cx - side / 2, cy - side * aspect / 2, cx + side / 2, cy + side * aspect / 2))
            else:
                per_image.append(draw(feature_box(h, w, max_side, per_image, allow_nonfinite=False)))
        boxes.append(torch.tensor(per_image, dtype=torch.float64).reshape(n, 4))
    return dict(
        dtype=draw(st.sampled_from([torch.float32, torch.float64])), batch=batch,
        channels=draw(st.integers(1, 3)), k_min=k_min, levels=levels, image=image, shapes=shapes, boxes=boxes,
        output_size=(draw(st.integers(1, 9)), draw(st.integers(1, 9))), sampling_ratio=sampling_ratio,
        canonical_scale=draw(st.sampled_from([224, 112, 56])), canonical_level=draw(st.sampled_from([4, 3])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@pytest.mark.parametrize("device", DEVICES)
@given(case=multiscale_cases())
def test_multiscale_roi_align_properties(device, case):
    """MultiScaleRoIAlign against torchvision's, forward and the gradient of every feature map;
    the sorted path (one roi_align per level) and the sync-free one (every level pools every
    RoI) agree; on CUDA, in training mode and with every kernel variant."""
    dtype = case["dtype"]
    names = [f"p{k}" for k in range(case["k_min"], case["k_min"] + case["levels"])]
    g = torch.Generator().manual_seed(case["seed"])
    feats = {}
    for k, name in zip(range(case["k_min"], case["k_min"] + case["levels"]), names):
        shape = (case["batch"], case["channels"], case["image"][0] // 2**k, case["image"][1] // 2**k)
        feats[name] = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).to(device)
    boxes = [b.to(dtype).to(device) for b in case["boxes"]]
    shapes = case["shapes"]
    kw = dict(canonical_scale=case["canonical_scale"], canonical_level=case["canonical_level"])
    size, sr = case["output_size"], case["sampling_ratio"]
    pooler = MultiScaleRoIAlign(names, size, sr, **kw).eval()
    tv_pooler = torchvision.ops.MultiScaleRoIAlign(names, size, sr, **kw)

    # the level and scale of each box, and the boxes on a rounding edge of their level's map
    rois = torch.cat([torch.cat([torch.full((b.size(0), 1), float(i), dtype=dtype, device=device), b], 1)
                      for i, b in enumerate(boxes)])
    pooler.setup_scales([feats[n] for n in names], shapes)
    levels = pooler.map_levels(boxes).cpu() if len(names) > 1 else torch.zeros(rois.size(0), dtype=torch.int64)
    fragile = torch.zeros(rois.size(0), dtype=torch.bool)
    for lvl, name in enumerate(names):
        on = levels == lvl
        if on.any():
            f, _, _ = fragile_rois(rois.cpu()[on], dtype, pooler.scales[lvl], size, sr, False,
                                   feats[name].size(2), feats[name].size(3))
            fragile[on] = f
    event(f"fragile boxes: {int(fragile.sum())}")
    grad = torch.randn((rois.size(0), case["channels"]) + tuple(size), generator=g, dtype=torch.float64).to(dtype)
    grad[fragile] = 0
    grad = grad.to(device)

    def run(module, sync_free=False):
        leaves = {n: t.detach().clone().requires_grad_() for n, t in feats.items()}
        if sync_free:
            module.setup_scales([leaves[n] for n in names], shapes)
            lv = module.map_levels(boxes) if len(names) > 1 else torch.zeros(rois.size(0), dtype=torch.int64, device=device)
            out = module._forward_without_sync([leaves[n] for n in names], rois, lv) if len(names) > 1 else \
                module(leaves, boxes, shapes)
        else:
            out = module(leaves, boxes, shapes)
        grads = torch.autograd.grad(out, [leaves[n] for n in names], grad, allow_unused=True) if out.numel() else \
            [None] * len(names)
        return out.detach(), [torch.zeros_like(feats[n]) if gr is None else gr for n, gr in zip(names, grads)]

    out, grads = run(pooler)
    assert out.shape == (rois.size(0), case["channels"]) + tuple(size) and out.dtype == dtype
    tv_out, tv_grads = run(tv_pooler) if device == "cpu" else (None, None)
    if device != "cpu":
        tv_leaves = {n: t.detach().cpu().requires_grad_() for n, t in feats.items()}
        tv_out = tv_pooler(tv_leaves, [b.cpu() for b in boxes], shapes)
        tv_grads = torch.autograd.grad(tv_out, [tv_leaves[n] for n in names], grad.cpu(), allow_unused=True) \
            if tv_out.numel() else [None] * len(names)
        tv_grads = [torch.zeros_like(feats[n]).cpu() if gr is None else gr for n, gr in zip(names, tv_grads)]
        tv_out = tv_out.detach()
    if device == "cpu":
        # one roi_align per level, as torchvision: the same bits forward
        assert torch.equal(bits(out), bits(tv_out)), "forward differs from torchvision"
    sync_out, sync_grads = run(MultiScaleRoIAlign(names, size, sr, **kw), sync_free=True)
    if device == "cpu":
        # the same kernel adds exact zeros from the other levels
        assert torch.equal(sync_out, out), "the sync-free path's values differ"
    # the reference and tolerances of roi_align at each level's scale
    oracles = [
        AlignOracle(feats[name], rois[(levels == lvl).to(device)], dict(
            dtype=dtype, scale=pooler.scales[lvl], output_size=size, sampling_ratio=sr, aligned=False,
            height=feats[name].size(2), width=feats[name].size(3)), grad[(levels == lvl).to(device)])
        for lvl, name in enumerate(names)
    ]
    for lvl, name in enumerate(names):
        on = levels == lvl
        oracle = oracles[lvl]
        oracle.assert_forward(out[on.to(device)], f"level {name} against the reference")
        oracle.assert_forward(out[on.to(device)], f"level {name} against torchvision", want=tv_out[on])
        oracle.assert_grad(grads[lvl], f"gradient of {name} against the reference")
        oracle.assert_grad(grads[lvl], f"gradient of {name} against torchvision", want=tv_grads[lvl])
        if device == "cpu":
            assert torch.equal(sync_grads[lvl], grads[lvl]), f"the sync-free path's gradient of {name} differs"
        else:
            # more RoIs per call: the selection may pick other kernels
            oracle.assert_forward(sync_out[on.to(device)], f"sync-free path, level {name}", want=out[on.to(device)])
            oracle.assert_grad(sync_grads[lvl], f"sync-free gradient of {name}", want=grads[lvl])

    if device != "cpu":
        # training mode (the sync-free path on CUDA) and every kernel variant
        for kernel in ROI_KERNELS:
            with roi_kernel(kernel):
                for train in (False, True):
                    o, grads_v = run(MultiScaleRoIAlign(names, size, sr, **kw).train(train))
                    for lvl, name in enumerate(names):
                        on = (levels == lvl).to(device)
                        what = f"roi_kernel({kernel!r}), train={train}, level {name}"
                        oracles[lvl].assert_forward(o[on], what, want=out[on])
                        oracles[lvl].assert_grad(grads_v[lvl], what, want=grads[lvl])


# --- the kernel-choice setting, and every kernel reached ------------------------------------------


def test_roi_kernel_names():
    """roi_kernel takes the five names, restores the previous choice, and rejects others,
    naming them all."""
    with pytest.raises(RuntimeError, match="kernel must be 'auto', 'band', 'gather', 'tiled' or 'generic', got 'planes'"):
        with roi_kernel("planes"):
            pass
    for name in ROI_KERNELS:
        with roi_kernel(name):
            with roi_kernel("generic"):
                pass
            assert detops._C._set_roi_kernel(name) == name
    assert detops._C._set_roi_kernel("auto") == "auto"


def _kernels_run(fn):
    """The CUDA kernels fn() launches, as the profiler names them (one string)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return " ".join(e.name for e in prof.events())


def _align_call(x, rois, size, sr, grad=True):
    def call():
        xi = x.detach().requires_grad_(grad)
        out = roi_align(xi, rois, size, 0.25, sr, True)
        if grad:
            out.backward(torch.ones_like(out))
    return call


def _pool_call(x, rois, size):
    def call():
        xi = x.detach().requires_grad_()
        out = roi_pool(xi, rois, size, 0.25)
        out.backward(torch.ones_like(out))
    return call


@pytest.mark.cuda
def test_cuda_every_kernel_is_reached():
    """Each CUDA row of the module docstring's table launches the kernel it names (kernel names
    as the profiler reports them); the properties compare their results. The float32 sliced
    band backward, which only tall maps take, is compared with the gather here."""
    dev = "cuda"
    g = torch.Generator().manual_seed(0)

    def maps(c, h, w, dtype=torch.float32):
        return torch.randn(2, c, h, w, generator=g).to(dev, dtype)

    def dense(h, w, k=12, dtype=torch.float32):
        xy = torch.rand(k, 2, generator=g) * torch.tensor([w, h]) * 0.6
        wh = torch.rand(k, 2, generator=g) * torch.tensor([w, h]) * 0.4 + 1
        idx = torch.randint(0, 2, (k, 1), generator=g).float()
        return torch.cat([idx, xy, xy + wh], 1).div(torch.tensor([1, 0.25, 0.25, 0.25, 0.25])).to(dev, dtype)

    def ran(pattern, names):
        return re.search(pattern, names) is not None

    x, r = maps(8, 16, 16), dense(16, 16)
    cases = [
        # (setting, dtype/layout note, call, kernel name patterns that must appear, that must not)
        ("band", _align_call(x, r, (3, 4), 2),
         [r"roi_align_band_forward_swizzled_kernel", r"roi_align_band_backward_swizzled_kernel<float, \d+, false>"], []),
        ("band", _align_call(x.double(), r.double(), (3, 4), 2),
         [r"roi_align_band_forward_kernel", r"roi_align_band_backward_kernel"], []),
        ("band", _align_call(x.half(), r.half(), (3, 4), 2),
         [r"roi_align_band_forward_swizzled_kernel", r"roi_align_band_backward_swizzled_kernel<[^>]*true>"], []),
        ("band", _align_call(x.bfloat16(), r.bfloat16(), (3, 4), 2),
         [r"roi_align_band_backward_swizzled_kernel<[^>]*true>"], []),
        ("auto", _align_call(x.to(memory_format=torch.channels_last), r, (3, 4), -1),
         [r"roi_align_forward_nhwc_kernel", r"roi_align_backward_tiled_kernel"], []),
        # NCHW with 32 channels and 8 reads per element: converted for the nhwc kernel
        ("auto", _align_call(maps(32, 4, 4), dense(4, 4, k=8), (2, 2), 2, grad=False),
         [r"roi_align_forward_nhwc_kernel"], [r"roi_align_forward_tiled_kernel"]),
        ("tiled", _align_call(x.to(memory_format=torch.channels_last), r, (3, 4), 2),
         [r"roi_align_forward_tiled_kernel", r"roi_align_backward_tiled_kernel"], [r"roi_align_forward_nhwc_kernel", r"band"]),
        ("generic", _align_call(x, r, (3, 4), 2),
         [r"roi_align_forward_kernel<", r"roi_align_backward_atomic_kernel"], [r"tiled", r"band"]),
        ("gather", _align_call(x, r, (3, 4), 2),
         [r"roi_align_forward_tiled_kernel", r"roi_align_backward_tiled_kernel"], [r"band"]),
        # more bins than a tiled block takes: "tiled" falls back to the selection's choice
        ("tiled", _align_call(x, r, (50, 50), 2, grad=False), [r"roi_align_forward_kernel<"], [r"tiled"]),
        ("band", _pool_call(maps(16, 12, 12), dense(12, 12), (3, 3)),
         [r"roi_pool_tile_forward_kernel", r"roi_pool_band_backward_kernel"], []),
        ("gather", _pool_call(maps(16, 12, 12).to(memory_format=torch.channels_last), dense(12, 12), (3, 3)),
         [r"roi_pool_forward_channels_kernel", r"roi_pool_backward_atomic_kernel"], [r"tile", r"band"]),
        ("gather", _pool_call(maps(16, 12, 12), dense(12, 12), (3, 3)),
         [r"roi_pool_forward_rows_kernel", r"roi_pool_backward_atomic_kernel"], [r"tile", r"band"]),
        ("tiled", _pool_call(maps(1, 12, 12), dense(12, 12, k=2), (3, 3)),
         [r"roi_pool_forward_rows_kernel", r"roi_pool_backward_atomic_kernel"], []),
    ]
    for setting, call, present, absent in cases:
        with roi_kernel(setting):
            names = _kernels_run(call)
        for pattern in present:
            assert ran(pattern, names), (setting, pattern, names)
        for pattern in absent:
            assert not ran(pattern, names), (setting, pattern, names)
    with deterministic_algorithms(True):
        names = _kernels_run(_align_call(x, r, (3, 4), 2))
        assert ran(r"deterministic", names) and not ran(r"atomic|band_backward|backward_tiled", names), names
        names = _kernels_run(_pool_call(maps(16, 12, 12), dense(12, 12), (3, 3)))
        assert ran(r"roi_pool_backward_segments_kernel", names) and not ran(r"atomic|band_backward", names), names

    # float32 bands without overlap: a map tall enough that overlapping bands would share half
    # their rows (bands of ~1200 rows of 2-pixel-wide, 32-byte pixels on an H100 or H200)
    xt = torch.randn(1, 1, 4000, 2, generator=g).to(dev)
    rt = torch.tensor([[0, 0.0, 0.0, 8.0, 16000.0], [0, 1.0, 100.0, 7.0, 9000.0]], device=dev)
    results = {}
    for setting in ("band", "gather"):
        with roi_kernel(setting):
            xi = xt.detach().requires_grad_()
            names = _kernels_run(lambda: roi_align(xi, rt, (1, 2), 0.25, 4, True).sum().backward())
        results[setting] = xi.grad
        if setting == "band":
            assert ran(r"roi_align_band_backward_swizzled_kernel<float, \d+, true>", names), names
    torch.testing.assert_close(results["band"], results["gather"], rtol=1e-5, atol=1e-6)
