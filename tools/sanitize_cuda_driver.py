#!/usr/bin/env python3
"""Calls every detops CUDA kernel, for compute-sanitizer (tools/sanitize_cuda.sh runs it under
memcheck, racecheck, initcheck and synccheck).

Each op is called through torch.ops.detops (and the detops.ops modules) with every kernel
variant the selection can pick forced in turn: roi_kernel 'auto', 'band', 'gather', 'tiled',
'generic' for roi_align and roi_pool; nms_kernel(rank, pass_) with rank 'auto', 'count',
'radix', 'sort' and pass 'auto', 'block', 'dataflow' for nms, batched_nms and nms_padded; the
deterministic backwards (torch.use_deterministic_algorithms) with the default pass limits and
with _C._set_deterministic_pass_limits lowered so that small inputs take the multi-pass paths;
NCHW, channels_last (the NHWC kernels) and strided inputs; every dtype (float32, float64,
float16, bfloat16); forward and backward; empty and odd shapes; autocast; a side stream.
Sizes are small, so that each sanitizer tool finishes in minutes; --quick trims the matrix
further for the slow tools (racecheck, initcheck).

Besides the sanitizers' checks, the driver compares what must agree (the NMS variants give the
same indices, roi_pool's variants the same values and argmax, the deterministic backwards the
same bits run to run) and exits 1 on a mismatch or an unexpected exception.

    python tools/sanitize_cuda_driver.py [--device cuda|cpu] [--quick] [--only OPS]
                                         [--kernels]

--device cpu runs the same calls on the CPU (the knobs are then no-ops), which checks the
driver itself on a machine without a GPU. --kernels (CUDA, without a
sanitizer) lists, from a profile of the run, the detops kernels of csrc/cuda that never ran.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import re
import sys
import time
import traceback
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import detops  # noqa: E402,F401  (loads detops._C and registers the ops)
from detops import _C  # noqa: E402
from detops.ops import MultiScaleRoIAlign, _utils  # noqa: E402



class _CalledOps:
    """torch.ops.detops, recording which ops the driver calls: a registered op that it never
    calls (a new op without its lines here) fails the run."""

    def __init__(self) -> None:
        self.called = set()

    def __getattr__(self, name: str):
        self.called.add(name)
        return getattr(torch.ops.detops, name)


OPS = _CalledOps()
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
ROI_KERNELS = ("auto", "band", "gather", "tiled", "generic")
NMS_RANKS = ("auto", "count", "radix", "sort")
NMS_PASSES = ("auto", "block", "dataflow")
SECTIONS = ("nms", "nms_padded", "roi_align", "roi_pool", "to_channels_last", "misc")

# (B, C, H, W, K, PH, PW): odd and empty shapes; channel counts that are and are not multiples
# of a 16-byte vector (the NHWC kernels need them) and of a warp; maps tall enough for the band
# kernels' bands of 16+ rows; a 32-channel NCHW map read 8+ times per element (converted for the
# NHWC kernel); a tall narrow map (the sliced band backward in float32) and a wide one (the
# plain band forward in float32); more bins than a tiled block holds.
ROI_SHAPES = (
    (1, 1, 1, 1, 3, 1, 1),
    (2, 3, 5, 7, 11, 2, 3),
    (2, 16, 24, 24, 40, 7, 7),
    (1, 32, 64, 48, 48, 7, 7),
    (2, 5, 33, 17, 9, 3, 3),
    (1, 8, 12, 12, 6, 24, 20),
    (1, 8, 200, 12, 20, 7, 7),
    (1, 4, 20, 480, 30, 7, 7),
    (1, 4, 9, 9, 0, 2, 2),
    (0, 4, 9, 9, 0, 2, 2),
    (2, 0, 9, 9, 5, 2, 2),
    (1, 3, 0, 5, 4, 2, 2),
)
QUICK_ROI_SHAPES = tuple(ROI_SHAPES[i] for i in (1, 2, 3, 5, 6, 8, 10))

# (sampling_ratio, aligned, spatial_scale) of the roi_align calls: fixed grids of 1 to 4 (the
# band kernels take those), the adaptive grid (0, and -1 which the op takes alike).
ALIGN_ARGS = ((2, True, 1.0), (1, False, 0.25), (4, True, 0.5), (0, True, 1.0), (-1, False, 1.0), (3, False, 1.0))
QUICK_ALIGN_ARGS = (ALIGN_ARGS[0], ALIGN_ARGS[1], ALIGN_ARGS[3])

LAYOUTS = ("nchw", "channels_last", "strided")


class Run:
    """Counts calls and collects failures (exceptions, mismatches) without stopping."""

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        self.calls = 0
        self.failures: List[str] = []

    def call(self, what: str, fn: Callable[[], object]) -> Optional[object]:
        self.calls += 1
        try:
            out = fn()
            if self.device.type == "cuda":
                torch.cuda.synchronize()  # a fault shows up here, next to its call
            return out
        except Exception as e:  # noqa: BLE001
            self.failures.append(f"{what}: {type(e).__name__}: {e}")
            traceback.print_exc(limit=3)
            return None

    def same(self, what: str, a, b) -> None:
        if a is None or b is None:
            return
        if not isinstance(a, (tuple, list)):
            a, b = (a,), (b,)
        for x, y in zip(a, b):
            if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x.nan_to_num(12345.0), y.nan_to_num(12345.0)):
                self.failures.append(f"{what}: results differ")
                return


# ---- knobs ------------------------------------------------------------------------------------


@contextlib.contextmanager
def deterministic(pass_limits: Tuple[int, int, bool] = (0, 0, False)) -> Iterator[None]:
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    previous = _C._set_deterministic_pass_limits(*pass_limits)
    try:
        yield
    finally:
        _C._set_deterministic_pass_limits(*previous)
        torch.use_deterministic_algorithms(was)


# ---- inputs -----------------------------------------------------------------------------------


def make_boxes(n: int, dtype: torch.dtype, non_finite: bool, seed: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """[n, 4] boxes and [n] scores: overlapping clusters, identical boxes, equal scores, zero-size
    and reversed boxes, huge ones, and (non_finite) NaN / inf coordinates and NaN scores."""
    g = torch.Generator().manual_seed(seed)
    centre = torch.rand(max(n // 8, 1), 2, generator=g, dtype=torch.float64) * 300
    c = centre[torch.randint(0, centre.shape[0], (n,), generator=g)] + torch.randn(n, 2, generator=g, dtype=torch.float64) * 8
    wh = torch.rand(n, 2, generator=g, dtype=torch.float64) * 40 + 0.5
    boxes = torch.cat([c - wh / 2, c + wh / 2], 1)
    scores = torch.rand(n, generator=g, dtype=torch.float64)
    i = torch.arange(n)
    if n > 1:
        boxes[i % 16 == 1] = boxes[(i[i % 16 == 1] - 1)]
        scores[i % 16 == 2] = scores[(i[i % 16 == 2] - 1)]
    boxes[i % 16 == 3, 2] = boxes[i % 16 == 3, 0]
    boxes[i % 16 == 4] = boxes[i % 16 == 4][:, [2, 3, 0, 1]]
    boxes[i % 16 == 5] = torch.tensor([-1e6, -1e6, 1e6, 1e6], dtype=torch.float64)
    if non_finite:
        boxes[i % 16 == 6, 1] = float("nan")
        boxes[i % 16 == 7, 3] = float("inf")
        scores[i % 16 == 8] = float("nan")
        boxes[i % 16 == 9, 0] = -float("inf")
    return boxes.to(device, dtype), scores.to(device, dtype)


def make_rois(k: int, batch: int, h: int, w: int, scale: float, dtype: torch.dtype, seed: int, device) -> torch.Tensor:
    """[k, 5] RoIs in image coordinates: a dense cluster (the band and tile kernels' case) and
    every kind the kernels must take: partly and wholly outside the map, huge, zero-size,
    reversed, the whole map, on the far edge, tiny."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for j in range(k):
        b = float(j % max(batch, 1))
        x1 = float(torch.rand(1, generator=g)) * w * 0.7
        y1 = float(torch.rand(1, generator=g)) * h * 0.7
        x2 = x1 + 1 + float(torch.rand(1, generator=g)) * w * 0.5
        y2 = y1 + 1 + float(torch.rand(1, generator=g)) * h * 0.5
        kind = j % 12
        if kind == 0:
            x1, y1 = -0.5 * w, -2.0
        elif kind == 1:
            x1, x2 = x1 + 2 * w, x2 + 2 * w
        elif kind == 2:
            x1, y1, x2, y2 = -1e5, -1e5, 1e5, 1e5
        elif kind == 3:
            x2, y2 = x1, y1
        elif kind == 4:
            x1, x2 = x2, x1
        elif kind == 5:
            x1, y1, x2, y2 = 0.0, 0.0, w - 1.0, h - 1.0
        elif kind == 6:
            x1, y1, x2, y2 = w - 0.25, h - 0.25, float(w), float(h)
        elif kind == 7:
            x2, y2 = x1 + 0.01, y1 + 0.01
        rows.append([b, x1 / scale, y1 / scale, x2 / scale, y2 / scale])
    if not rows:
        return torch.zeros(0, 5, dtype=dtype, device=device)
    return torch.tensor(rows, dtype=torch.float64).to(device, dtype)


def in_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "channels_last":
        return x.contiguous(memory_format=torch.channels_last)
    if layout == "strided":  # every other column of a map twice as wide
        wide = torch.zeros(*x.shape[:3], 2 * x.shape[3], dtype=x.dtype, device=x.device)
        view = wide[..., ::2]
        view.copy_(x)
        return view
    return x.contiguous()


# ---- sections ---------------------------------------------------------------------------------


def nms_section(run: Run, variants: List[Tuple[str, str]], quick: bool) -> None:
    dev = run.device
    sizes = (0, 1, 33, 700) if quick else (0, 1, 33, 700, 2100, 5000)
    thresholds = (0.5, -0.1) if quick else (0.5, 0.0, 1.0, -0.1)
    first: Dict[tuple, object] = {}
    for rank, pass_ in variants:
        with _utils.nms_kernel(rank, pass_):
            for dt in DTYPES:
                for n in sizes:
                    for nf in (False, True):
                        boxes, scores = make_boxes(n, dt, nf, n, dev)
                        idxs = (torch.arange(n, device=dev) * 7919 % 13 - 3) * (1 + (torch.arange(n, device=dev) > n // 2))
                        for thr in thresholds:
                            tag = (dt, n, nf, thr)
                            what = f"nms rank={rank} pass={pass_} {dt} n={n} nf={nf} thr={thr}"
                            got = run.call(what, lambda: OPS.nms(boxes, scores, thr))
                            got_b = run.call("batched_" + what, lambda: OPS.batched_nms(boxes, scores, idxs, thr))
                            run.same(what, got, first.setdefault(("nms",) + tag, got))
                            run.same("batched_" + what, got_b, first.setdefault(("batched",) + tag, got_b))
                        # strided boxes, float64 scores (ranks that take only the boxes' dtype
                        # fall back), int32 categories
                        bt = boxes.t().contiguous().t()
                        s64 = scores.double()
                        run.call(f"nms strided {dt} n={n}", lambda: OPS.nms(bt, s64, 0.5))
                        run.call(
                            f"batched_nms int32 idxs {dt} n={n}",
                            lambda: OPS.batched_nms(bt, scores, idxs.int(), 0.5),
                        )


def nms_padded_section(run: Run, variants: List[Tuple[str, str]], quick: bool) -> None:
    dev = run.device
    ranks = sorted({r for r, _ in variants}, key=NMS_RANKS.index)
    batches = (0, 1, 3)
    sizes = (0, 1, 40, 600) if quick else (0, 1, 40, 600, 3000)
    first: Dict[tuple, object] = {}
    for rank in ranks:
        with _utils.nms_kernel(rank, "auto"):
            for dt in DTYPES:
                for b in batches:
                    for n in sizes:
                        parts = [make_boxes(n, dt, j % 2 == 1, 100 * j + n, dev) for j in range(b)]
                        boxes = torch.stack([p[0] for p in parts]) if b else torch.zeros(0, n, 4, dtype=dt, device=dev)
                        scores = torch.stack([p[1] for p in parts]) if b else torch.zeros(0, n, dtype=dt, device=dev)
                        for max_output in (0, 1, 100):
                            for sthr in (-float("inf"), 0.3):
                                for thr in (0.5, -0.1):
                                    tag = (dt, b, n, max_output, sthr, thr)
                                    what = f"nms_padded rank={rank} {tag}"
                                    got = run.call(what, lambda: OPS.nms_padded(boxes, scores, thr, sthr, max_output))
                                    run.same(what, got, first.setdefault(tag, got))
                        run.call(
                            f"nms_padded mixed dtypes {dt} b={b} n={n}",
                            lambda: OPS.nms_padded(boxes.transpose(1, 2).contiguous().transpose(1, 2), scores.double(), 0.5, -1.0, 10),
                        )


def roi_align_section(run: Run, kernels: List[str], quick: bool) -> None:
    dev = run.device
    shapes = QUICK_ROI_SHAPES if quick else ROI_SHAPES
    args = QUICK_ALIGN_ARGS if quick else ALIGN_ARGS
    for kernel in kernels:
        with _utils.roi_kernel(kernel):
            for dt in DTYPES:
                for si, (b, c, h, w, k, ph, pw) in enumerate(shapes):
                    x0 = torch.randn(b, c, h, w, generator=torch.Generator().manual_seed(si), dtype=torch.float64).to(dev, dt)
                    for layout in LAYOUTS:
                        x = in_layout(x0, layout)
                        for sr, aligned, scale in args:
                            rois = make_rois(k, b, h, w, scale, dt, si, dev)
                            what = f"roi_align kernel={kernel} {dt} shape={(b, c, h, w, k, ph, pw)} {layout} sr={sr}"

                            def fwd_bwd():
                                out = OPS.roi_align(x, rois, scale, ph, pw, sr, aligned)
                                g = torch.randn_like(out)
                                OPS._roi_align_backward(g, rois, scale, ph, pw, b, c, h, w, sr, aligned)
                                # a strided gradient
                                g2 = torch.cat([g, g], 3)[..., ::2]
                                OPS._roi_align_backward(g2, rois, scale, ph, pw, b, c, h, w, sr, aligned)

                            run.call(what, fwd_bwd)
                        sr, aligned, scale = args[0]
                        rois = make_rois(k, b, h, w, scale, dt, si, dev)

                        def autograd():
                            xg = x.detach().requires_grad_(True)
                            out = OPS.roi_align(xg, rois, scale, ph, pw, sr, aligned)
                            out.backward(torch.ones_like(out))

                        run.call(f"roi_align autograd kernel={kernel} {dt} {layout}", autograd)
    # the deterministic backward: default limits, then limits low enough for passes over chunks of
    # RoIs and slices of channels, and int64 keys; bit-identical run to run
    for limits in ((0, 0, False), (37, 3, True), (200, 0, False)):
        with deterministic(limits):
            for dt in DTYPES:
                for si, (b, c, h, w, k, ph, pw) in enumerate(shapes):
                    for sr, aligned, scale in args[:2]:
                        rois = make_rois(k, b, h, w, scale, dt, si, dev)
                        g = torch.randn(k, c, ph, pw, generator=torch.Generator().manual_seed(si), dtype=torch.float64).to(dev, dt)
                        what = f"roi_align deterministic backward limits={limits} {dt} shape={(b, c, h, w, k, ph, pw)}"
                        call = lambda: OPS._roi_align_backward(g, rois, scale, ph, pw, b, c, h, w, sr, aligned)  # noqa: E731
                        run.same(what, run.call(what, call), run.call(what, call))


def roi_pool_section(run: Run, kernels: List[str], quick: bool) -> None:
    dev = run.device
    shapes = QUICK_ROI_SHAPES if quick else ROI_SHAPES
    # roi_pool has band / tile and gather kernels; 'tiled' and 'generic' choose as 'auto' there
    names = [n for n in kernels if n in ("auto", "band", "gather")]
    first: Dict[tuple, object] = {}
    for kernel in names:
        with _utils.roi_kernel(kernel):
            for dt in DTYPES:
                for si, (b, c, h, w, k, ph, pw) in enumerate(shapes):
                    x0 = torch.randn(b, c, h, w, generator=torch.Generator().manual_seed(si), dtype=torch.float64).to(dev, dt)
                    if x0.numel():  # ties and NaN: the first maximum wins, NaN never does
                        x0[:, 0] = 1.0
                        x0[:, -1, 0] = float("nan")
                    for layout in LAYOUTS:
                        x = in_layout(x0, layout)
                        for scale in (1.0, 0.5):
                            rois = make_rois(k, b, h, w, scale, dt, si, dev)
                            tag = (dt, si, layout, scale)
                            what = f"roi_pool kernel={kernel} {dt} shape={(b, c, h, w, k, ph, pw)} {layout} scale={scale}"

                            def fwd_bwd():
                                out, argmax = OPS.roi_pool(x, rois, scale, ph, pw)
                                values = OPS._roi_pool_values(x, rois, scale, ph, pw)
                                g = torch.randn_like(out)
                                OPS._roi_pool_backward(g, rois, argmax, scale, ph, pw, b, c, h, w)
                                # strided gradient and argmax
                                OPS._roi_pool_backward(
                                    torch.cat([g, g], 2)[:, :, ::2], rois, torch.cat([argmax, argmax], 3)[..., ::2],
                                    scale, ph, pw, b, c, h, w,
                                )
                                return out, argmax, values

                            got = run.call(what, fwd_bwd)
                            if got is not None:
                                run.same(what + " values", got[2], got[0])
                                run.same(what, got[:2], first.setdefault(tag, got[:2]))

                        def autograd():
                            xg = x.detach().requires_grad_(True)
                            rois = make_rois(k, b, h, w, 1.0, dt, si, dev)
                            OPS._roi_pool_values(xg, rois, 1.0, ph, pw).sum().backward()

                        run.call(f"roi_pool autograd kernel={kernel} {dt} {layout}", autograd)
    with deterministic():
        for dt in DTYPES:
            for si, (b, c, h, w, k, ph, pw) in enumerate(shapes):
                x = torch.randn(b, c, h, w, generator=torch.Generator().manual_seed(si), dtype=torch.float64).to(dev, dt)
                rois = make_rois(k, b, h, w, 1.0, dt, si, dev)
                what = f"roi_pool deterministic backward {dt} shape={(b, c, h, w, k, ph, pw)}"
                out = run.call(what + " forward", lambda: OPS.roi_pool(x, rois, 1.0, ph, pw))
                if out is None:
                    continue
                g = torch.randn_like(out[0])
                call = lambda: OPS._roi_pool_backward(g, rois, out[1], 1.0, ph, pw, b, c, h, w)  # noqa: E731
                run.same(what, run.call(what, call), run.call(what, call))


def to_channels_last_section(run: Run, quick: bool) -> None:
    dev = run.device
    for dt in DTYPES:
        for si, (b, c, h, w, _, _, _) in enumerate(QUICK_ROI_SHAPES if quick else ROI_SHAPES):
            x0 = torch.randn(b, c, h, w, generator=torch.Generator().manual_seed(si), dtype=torch.float64).to(dev, dt)
            for layout in LAYOUTS:
                x = in_layout(x0, layout)
                y = run.call(f"_to_channels_last {dt} {layout}", lambda: OPS._to_channels_last(x))
                if y is not None:
                    run.same(f"_to_channels_last {dt} {layout}", y, x)
                    if not y.is_contiguous(memory_format=torch.channels_last):
                        run.failures.append(f"_to_channels_last {dt} {layout}: not channels_last")


def misc_section(run: Run) -> None:
    """Autocast, MultiScaleRoIAlign, a side stream."""
    dev = run.device
    x = torch.randn(2, 16, 20, 20, device=dev)
    rois = make_rois(24, 2, 20, 20, 1.0, torch.float32, 0, dev)
    half = torch.float16 if dev.type == "cuda" else torch.bfloat16

    def autocast():
        with torch.autocast(dev.type, dtype=half):
            xg = x.detach().requires_grad_(True)
            a = OPS.roi_align(xg, rois, 1.0, 7, 7, 2, True)
            p = OPS._roi_pool_values(xg, rois, 1.0, 7, 7)
            (a.float().sum() + p.float().sum()).backward()

    run.call("autocast", autocast)

    def poolers():
        feats = {"p2": torch.randn(2, 8, 32, 32, device=dev), "p3": torch.randn(2, 8, 16, 16, device=dev)}
        boxes = [make_rois(13, 1, 128, 128, 1.0, torch.float32, j, dev)[:, 1:].abs() for j in range(2)]
        pooler = MultiScaleRoIAlign(["p2", "p3"], 7, 2)
        pooler(feats, boxes, [(128, 128), (128, 128)]).sum()

    run.call("MultiScaleRoIAlign", poolers)
    if dev.type == "cuda":
        stream = torch.cuda.Stream()

        def side_stream():
            with torch.cuda.stream(stream):
                out = OPS.roi_align(x, rois, 1.0, 7, 7, 2, True)
                OPS.nms(rois[:, 1:], rois[:, 0], 0.5)
                OPS._roi_align_backward(torch.ones_like(out), rois, 1.0, 7, 7, 2, 16, 20, 20, 2, True)
            stream.synchronize()

        run.call("side stream", side_stream)


# ---- kernel coverage --------------------------------------------------------------------------

GLOBAL_RE = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)")


def declared_kernels() -> List[str]:
    """Names of the __global__ functions of csrc/cuda."""
    names = set()
    folder = os.path.join(ROOT, "csrc", "cuda")
    for name in sorted(os.listdir(folder)):
        if name.endswith((".cu", ".cuh", ".h")):
            with open(os.path.join(folder, name)) as f:
                names.update(GLOBAL_RE.findall(f.read()))
    return sorted(names)


def kernel_base(name: str) -> str:
    """'void detops::ops::(anonymous namespace)::foo_kernel<float, 8>(long, ...)' -> 'foo_kernel'."""
    name = name.replace("(anonymous namespace)", "").split("<", 1)[0].split("(", 1)[0]
    parts = name.rsplit("::", 1)[-1].split()
    return parts[-1] if parts else name


# ---- main -------------------------------------------------------------------------------------


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--quick", action="store_true", help="a smaller matrix, for racecheck and initcheck")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {','.join(SECTIONS)}")
    p.add_argument("--kernels", action="store_true", help="list the csrc/cuda kernels the run never launched")
    args = p.parse_args(argv)
    sections = [s for s in args.only.split(",") if s]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        p.error(f"unknown sections {unknown}; choose from {SECTIONS}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("sanitize_cuda_driver: no CUDA device", file=sys.stderr)
        return 2
    if args.device == "cuda" and not _C.with_cuda():
        print("sanitize_cuda_driver: detops._C was built without CUDA kernels", file=sys.stderr)
        return 2

    kernels = list(ROI_KERNELS)
    variants = list(itertools.product(NMS_RANKS, NMS_PASSES))

    run = Run(args.device)
    profiler = None
    if args.kernels:
        if args.device != "cuda":
            p.error("--kernels needs --device cuda")
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        profiler.__enter__()
    started = time.time()
    for name in sections:
        t0, c0 = time.time(), run.calls
        if name == "nms":
            nms_section(run, variants, args.quick)
        elif name == "nms_padded":
            nms_padded_section(run, variants, args.quick)
        elif name == "roi_align":
            roi_align_section(run, kernels, args.quick)
        elif name == "roi_pool":
            roi_pool_section(run, kernels, args.quick)
        elif name == "to_channels_last":
            to_channels_last_section(run, args.quick)
        else:
            misc_section(run)
        print(f"  {name:<18} {run.calls - c0:6d} calls {time.time() - t0:7.1f} s", flush=True)
    status = 0
    if profiler is not None:
        profiler.__exit__(None, None, None)
        ran = {kernel_base(e.name) for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA}
        never = [k for k in declared_kernels() if k not in ran]
        print(f"kernels of csrc/cuda launched: {len(declared_kernels()) - len(never)} of {len(declared_kernels())}")
        for k in never:
            print(f"  never launched: {k}")
    if sections == list(SECTIONS):
        from detops.testing import registered_ops

        for op in sorted(set(registered_ops()) - OPS.called):
            run.failures.append(f"registered op {op} is never called by this driver: add its calls")
    for f in run.failures:
        print("FAIL: " + f)
    if run.failures:
        status = 1
    print(
        f"sanitize_cuda_driver: {run.calls} calls on {args.device}{' (quick)' if args.quick else ''}, "
        f"{len(run.failures)} failures, {time.time() - started:.1f} s"
    )
    return status


if __name__ == "__main__":
    sys.exit(main())
