"""RoI kernels side by side on CUDA: each detops kernel choice (auto / band / gather) and
torchvision on the benchmark inputs of bench_roi (2x256x200x304, 1024 RoIs, sampling ratio 2),
forward, backward alone and forward+backward, with a check that every choice gives
torchvision's result first.

    python -m benchmarks.roi_kernels [--ops roi_align,roi_pool] [--dtypes fp32,fp16]
"""
from __future__ import annotations

import argparse

import torch
import torchvision

import detops
from benchmarks.bench_roi import DTYPES, fwd_bwd
from benchmarks.timing import HEADER, Row, format_row, median_ms
from detops.ops._utils import roi_kernel
from detops.testing import random_rois

CHOICES = ("auto", "band", "gather")


def _ops(name: str, size: int):
    if name == "roi_align":
        return (
            lambda a, r: detops.ops.roi_align(a, r, size, 0.25, 2, True),
            lambda a, r: torchvision.ops.roi_align(a, r, size, 0.25, 2, True),
        )
    return (
        lambda a, r: detops.ops.roi_pool(a, r, size, 0.25),
        lambda a, r: torchvision.ops.roi_pool(a, r, size, 0.25),
    )


def _bwd_only(fn, x, rois, grad):
    """The backward of one forward, timed alone: the forward runs outside the closure."""
    x = x.detach().requires_grad_()
    out = fn(x, rois)
    return lambda: torch.autograd.grad(out, x, grad, retain_graph=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ops", default="roi_align,roi_pool")
    p.add_argument("--dtypes", default="fp32")
    p.add_argument("--sizes", default="7")
    p.add_argument("--channels-last", action="store_true", help="also time channels_last input")
    p.add_argument("--runs", type=int, default=30)
    a = p.parse_args()
    shape = (2, 256, 200, 304)
    k = 1024
    print(HEADER)
    for dname in a.dtypes.split(","):
        dtype = DTYPES[dname]
        g = torch.Generator().manual_seed(0)
        x = torch.randn(*shape, generator=g).to("cuda", dtype)
        rois = random_rois(k, shape[0], shape[2], shape[3], seed=0, spatial_scale=0.25).to("cuda", dtype)
        layouts = [("", x)]
        if a.channels_last:
            layouts.append((", channels_last", x.contiguous(memory_format=torch.channels_last)))
        for op in a.ops.split(","):
            for size in (int(s) for s in a.sizes.split(",")):
                ours, theirs = _ops(op, size)
                tv_ok = dtype != torch.bfloat16
                grad = torch.randn(k, shape[1], size, size, device="cuda", dtype=dtype)
                for layout, xin in layouts:
                    tag = f"{op} {size}x{size} {dname}{layout}"
                    ref = fwd_bwd(theirs, xin.float(), rois.float(), grad.float()) if tv_ok else None
                    ref_out = theirs(xin.float(), rois.float()) if tv_ok else None
                    tol = 1e-4 if dtype == torch.float32 else 3e-2
                    tv = {}
                    if tv_ok:
                        tv["fwd"] = median_ms(lambda: theirs(xin, rois), "cuda", runs=a.runs)
                        tv["bwd"] = median_ms(_bwd_only(theirs, xin, rois, grad), "cuda", runs=a.runs)
                        tv["fwd+bwd"] = median_ms(lambda: fwd_bwd(theirs, xin, rois, grad), "cuda", runs=a.runs)
                    for choice in CHOICES:
                        with roi_kernel(choice):
                            if ref is not None:
                                torch.testing.assert_close(ours(xin, rois).float(), ref_out, rtol=tol, atol=tol)
                                got = fwd_bwd(ours, xin, rois, grad).float()
                                # gradients sum many terms: a looser bound in half precision
                                torch.testing.assert_close(got, ref, rtol=tol * 10, atol=tol * 10)
                            times = {
                                "fwd": median_ms(lambda: ours(xin, rois), "cuda", runs=a.runs),
                                "bwd": median_ms(_bwd_only(ours, xin, rois, grad), "cuda", runs=a.runs),
                                "fwd+bwd": median_ms(lambda: fwd_bwd(ours, xin, rois, grad), "cuda", runs=a.runs),
                            }
                        for part, t in times.items():
                            print(format_row(Row(f"{tag} {part}, kernel {choice}", "cuda", t, tv.get(part))), flush=True)


if __name__ == "__main__":
    main()
