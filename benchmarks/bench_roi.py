"""roi_align / roi_pool: detops vs torchvision on the same features and RoIs.

The CUDA cases follow the Mask R-CNN box head: features 2x256x200x304 (stride 4 of an
800x1216 batch), 1024 RoIs, output 7x7 and 14x14, sampling ratio 2, aligned=True. Their floor
is the bytes the call must move at the GPU's peak DRAM bandwidth (`byte_count`).
"""
from __future__ import annotations

import argparse
from typing import List

import torch
import torchvision

import detops
from benchmarks.timing import HEADER, Row, byte_floor, compare, cpu_cores, dram_bandwidth, format_ms, format_row, median_ms
from detops.testing import random_rois

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def _inputs(device, dtype, batch, channels, height, width, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, channels, height, width, generator=g).to(device, dtype)
    rois = random_rois(k, batch, height, width, seed=seed, spatial_scale=0.25).to(device, dtype)
    return x, rois


def fwd_bwd(fn, x, rois, grad):
    """x's gradient through fn(x, rois) for the output gradient `grad`."""
    x = x.detach().requires_grad_()
    fn(x, rois).backward(grad)
    return x.grad


def _check_close(ours, tv_fn, x, rois, dtype):
    """detops in `dtype` against torchvision in float32 on the same (rounded) inputs:
    torchvision computes half-precision RoI coordinates in half, detops in float32."""
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(ours.float(), tv_fn(x.float(), rois.float()), rtol=tol, atol=tol)


def _case_tag(shape, k, size, dtype) -> str:
    """A row's case: the map's shape, the RoI count, the output size and the dtype."""
    return f"{shape[0]}x{shape[1]}x{shape[2]}x{shape[3]}, {k} RoIs, {size}x{size}, {DTYPE_NAMES[dtype]}"


def byte_count(op: str, part: str, x, rois, size: int, argmax_size: int = 4) -> int:
    """The bytes a call must move at least: every tensor it reads or writes, once each.
    fwd: the map and the RoIs read, the output written (roi_pool's forward without a gradient
    writes no argmax). bwd: the output gradient and the RoIs read (roi_pool: the argmax too),
    the map's gradient written. fwd+bwd: both, roi_pool's forward then writing its argmax
    (`argmax_size` bytes an element)."""
    out = rois.size(0) * x.size(1) * size * size
    map_bytes, out_bytes = x.numel() * x.element_size(), out * x.element_size()
    roi_bytes = rois.numel() * rois.element_size()
    argmax = out * argmax_size if op == "roi_pool" else 0
    fwd = map_bytes + roi_bytes + out_bytes
    bwd = out_bytes + roi_bytes + argmax + map_bytes
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + argmax + bwd}[part]


def _floor(op: str, part: str, x, rois, size: int):
    """The CUDA case's byte floor at the GPU's peak bandwidth; None on the CPU."""
    if x.device.type != "cuda":
        return None
    argmax_size = 4
    if op == "roi_pool":
        argmax_size = torch.ops.detops.roi_pool(x[:, :1], rois, 0.25, 1, 1)[1].element_size()
    return byte_floor(byte_count(op, part, x, rois, size, argmax_size), dram_bandwidth())


def _fwd_rows(op, tag, device, ours, theirs, x, rois, grad, runs, layout="") -> List[Row]:
    """The forward and forward+backward rows of one op on (x, rois); theirs None: detops alone."""
    size = grad.size(-1)
    return [
        compare(f"{op} fwd{layout}, {tag}", device, lambda: ours(x, rois), (lambda: theirs(x, rois)) if theirs else None,
                floor=_floor(op, "fwd", x, rois, size), **runs),
        compare(
            f"{op} fwd+bwd{layout}, {tag}", device,
            lambda: fwd_bwd(ours, x, rois, grad),
            (lambda: fwd_bwd(theirs, x, rois, grad)) if theirs else None,
            floor=_floor(op, "fwd+bwd", x, rois, size),
            **runs,
        ),
    ]


def default_thread_counts() -> List[int]:
    """The thread counts whose scaling the CPU rows report: torch's thread count, and the
    number of physical cores where that is fewer."""
    n = torch.get_num_threads()
    physical = cpu_cores()[1]
    return sorted({n} | ({physical} if physical and 1 < physical < n else set()))


def _cpu_threads(x, rois, grad, size, runs, threads=None) -> List[Row]:
    """CPU rows at one thread (torchvision's CPU kernels use one), then detops' scaling: its
    one-thread time over its N-thread time for each N in `threads` (default_thread_counts());
    the target is 0.7 * N."""
    n = torch.get_num_threads()
    threads = [t for t in (threads or default_thread_counts()) if t > 1]
    shape = "x".join(str(s) for s in x.shape)
    tag = f"{shape}, {rois.size(0)} RoIs, {size}x{size}, fp32"
    ops = {
        "roi_align": (
            lambda a, r: detops.ops.roi_align(a, r, size, 0.25, 2, True),
            lambda a, r: torchvision.ops.roi_align(a, r, size, 0.25, 2, True),
        ),
        "roi_pool": (
            lambda a, r: detops.ops.roi_pool(a, r, size, 0.25),
            lambda a, r: torchvision.ops.roi_pool(a, r, size, 0.25),
        ),
    }
    cases = []
    for name, (ours, theirs) in ops.items():
        cases.append((f"{name} fwd", lambda o=ours: o(x, rois), lambda t=theirs: t(x, rois)))
        cases.append((f"{name} fwd+bwd", lambda o=ours: fwd_bwd(o, x, rois, grad), lambda t=theirs: fwd_bwd(t, x, rois, grad)))
    # What the machine itself gives: an element-wise torch op (at::parallel_for over equal
    # chunks, no shared data), timed the same way; its scaling bounds what any kernel can show.
    ref_in = torch.randn(x.numel() // 4 * 8)
    ref_out = torch.empty_like(ref_in)
    cases.append((f"reference: torch.sin on {ref_in.numel() / 1e6:.1f}M fp32 (torch's own kernel)",
                  lambda: torch.sin(ref_in, out=ref_out), None))
    rows: List[Row] = []
    try:
        torch.set_num_threads(1)
        one = []
        for case, ours, theirs in cases:
            label = f"{case}, 1 thread" if theirs is None else f"{case}, 1 thread, {tag}"
            rows.append(compare(label, "cpu", ours, theirs, **runs))
            one.append(rows[-1].detops_ms)
    finally:
        torch.set_num_threads(n)
    try:
        for t in threads:
            torch.set_num_threads(t)
            for (case, ours, _), t1 in zip(cases, one):
                tn = median_ms(ours, "cpu", **{**runs, "warmup": 5})  # warm-up: the pool resizes
                note = f"scaling {t1 / tn:.2f}x = {format_ms(t1)} / {format_ms(tn)} (target {0.7 * t:.1f}x)"
                reference = case.startswith("reference")
                label = f"{case}, 1 vs {t} threads" if reference else f"{case}, detops 1 vs {t} threads, {tag}"
                row = Row(label, "cpu", tn, None, note=note)
                print(format_row(row), flush=True)
                rows.append(row)
    finally:
        torch.set_num_threads(n)
    return rows


def run(devices: List[str], quick: bool = False, threads: List[int] = None) -> List[Row]:
    rows: List[Row] = []
    for device in devices:
        if device == "cuda":
            shape = (2, 256, 200, 304)
            k = 1024
            dtypes = [torch.float32, torch.float16, torch.bfloat16]
            sizes = [7, 14]
        else:
            shape = (2, 64, 100, 152) if not quick else (1, 16, 50, 76)
            k = 256 if not quick else 32
            dtypes = [torch.float32]
            sizes = [7]
        # CPU: up to 20 runs, at most about 5 s a case (torchvision's slow cases take 3-5)
        runs = dict(runs=30, warmup=5) if device == "cuda" else dict(runs=20, warmup=2, max_seconds=5)
        for dtype in dtypes:
            x, rois = _inputs(device, dtype, *shape, k)
            tv_ok = dtype != torch.bfloat16  # torchvision has no bfloat16 roi_align
            for size in sizes:
                ours = lambda a, r: detops.ops.roi_align(a, r, size, 0.25, 2, True)
                theirs = lambda a, r: torchvision.ops.roi_align(a, r, size, 0.25, 2, True)
                _check_close(ours(x, rois), theirs, x, rois, dtype)
                tag = _case_tag(shape, k, size, dtype)
                grad = torch.randn(k, shape[1], size, size, device=device, dtype=dtype)
                rows += _fwd_rows("roi_align", tag, device, ours, theirs if tv_ok else None, x, rois, grad, runs)
                if device == "cuda" and dtype == torch.float32:
                    xcl = x.contiguous(memory_format=torch.channels_last)
                    rows += _fwd_rows("roi_align", tag, device, ours, theirs, xcl, rois, grad, runs, layout=", channels_last input")
                    torch.use_deterministic_algorithms(True)
                    try:
                        rows.append(compare(f"roi_align fwd+bwd deterministic, {tag}", device, lambda: fwd_bwd(ours, x, rois, grad), None,
                                           floor=_floor("roi_align", "fwd+bwd", x, rois, size), **runs))
                        # the backward op alone (torchvision has no deterministic CUDA backward)
                        bwd_args = (rois, 0.25, size, size, *shape, 2, True)
                        rows.append(
                            compare(
                                f"roi_align bwd only deterministic, {tag}", device,
                                lambda: torch.ops.detops._roi_align_backward(grad, *bwd_args), None,
                                floor=_floor("roi_align", "bwd", x, rois, size), **runs,
                            )
                        )
                    finally:
                        torch.use_deterministic_algorithms(False)
            if dtype == torch.float32 or device == "cuda":
                for size in sizes:
                    ours_p = lambda a, r: detops.ops.roi_pool(a, r, size, 0.25)
                    theirs_p = lambda a, r: torchvision.ops.roi_pool(a, r, size, 0.25)
                    _check_close(ours_p(x, rois), theirs_p, x, rois, dtype)
                    tag = _case_tag(shape, k, size, dtype)
                    grad = torch.randn(k, shape[1], size, size, device=device, dtype=dtype)
                    rows += _fwd_rows("roi_pool", tag, device, ours_p, theirs_p if tv_ok else None, x, rois, grad, runs)
                    if device == "cuda" and dtype == torch.float32:
                        xcl = x.contiguous(memory_format=torch.channels_last)
                        rows += _fwd_rows(
                            "roi_pool", tag, device, ours_p, theirs_p, xcl, rois, grad, runs, layout=", channels_last input"
                        )
                        torch.use_deterministic_algorithms(True)
                        try:
                            rows.append(compare(f"roi_pool fwd+bwd deterministic, {tag}", device, lambda: fwd_bwd(ours_p, x, rois, grad), None,
                                               floor=_floor("roi_pool", "fwd+bwd", x, rois, size), **runs))
                        finally:
                            torch.use_deterministic_algorithms(False)
                if device == "cpu":
                    rows += _cpu_threads(x, rois, grad, size, runs, threads)
    return rows


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", choices=["cpu", "cuda", "all"], default="all")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", help="CPU thread counts to report scaling for, e.g. 2,4,8,16 "
                   "(default: torch's thread count and the physical core count)")
    a = p.parse_args()
    devs = ["cpu", "cuda"] if a.device == "all" else [a.device]
    devs = [d for d in devs if d == "cpu" or torch.cuda.is_available()]
    logical, physical = cpu_cores()
    print(f"CPU: {logical} logical CPUs, {physical or 'unknown'} physical cores, torch threads {torch.get_num_threads()}")
    print(HEADER)
    run(devs, quick=a.quick, threads=[int(t) for t in a.threads.split(",")] if a.threads else None)
