"""Per-block timeline of the float32 roi_align band forward (roi_align_band_forward_rotated_kernel).

Needs a build with benchmarks/band_trace.patch applied (it is not part of the library):

    git apply benchmarks/band_trace.patch
    TORCH_CUDA_ARCH_LIST=9.0 python setup.py build_ext --inplace
    python -m benchmarks.band_trace --sizes 7,14
    git apply -R benchmarks/band_trace.patch

With the patch, each block of the kernel writes its SM, its start and end (global timer and SM
clock), the clock when its lists were read and when its first band was staged, and its count
of bin rows into an int64 buffer whose address DETOPS_BAND_TRACE holds. This script runs the
benchmark inputs (2x256x200x304 float32 maps, 1024 RoIs, sampling ratio 2, aligned), once alone
and once behind five calls issued back to back, and prints where each SM's time went: staging,
computing, the gaps between its blocks, and the time it sat idle at the end of the kernel.
"""
import argparse
import os
import statistics

import torch

import detops
from detops.testing import random_rois


def spread(name, xs):
    xs = sorted(xs)
    n = len(xs)
    if n:
        print(
            f"  {name}: n {n}, min {xs[0]:.2f}, p10 {xs[n // 10]:.2f}, median {xs[n // 2]:.2f}, "
            f"p90 {xs[9 * n // 10]:.2f}, max {xs[-1]:.2f}"
        )


def trace(x, rois, size, back_to_back, buf):
    fn = lambda: detops.ops.roi_align(x, rois, size, 0.25, 2, True)  # noqa: E731
    os.environ["DETOPS_BAND_TRACE"] = str(buf.data_ptr())
    try:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        buf.zero_()
        torch.cuda.synchronize()
        for _ in range(6 if back_to_back else 1):
            fn()  # the last call's records stay
        torch.cuda.synchronize()
    finally:
        del os.environ["DETOPS_BAND_TRACE"]
    r = buf.view(-1, 8).cpu()
    return r[r[:, 1] != 0].tolist()


def report(records, title):
    t0 = min(b[1] for b in records)
    t1 = max(b[7] for b in records)
    # SM clock cycles per nanosecond of the global timer, over the longer blocks
    rate = statistics.median((b[6] - b[2]) / (b[7] - b[1]) for b in records if b[7] - b[1] > 5000)
    us = lambda cycles: cycles / rate / 1e3  # noqa: E731
    work = [b for b in records if b[4] & 0xFFFFFFFF]
    early = [b for b in work if b[4] >> 32]
    late = [b for b in work if not b[4] >> 32]
    sms = {}
    for b in records:
        sms.setdefault(b[0], []).append(b)
    print(
        f"{title}: kernel {(t1 - t0) / 1e3:.1f} µs, {len(records)} blocks ({len(work)} with bin rows, "
        f"{len(early)} staged before the lists), {len(sms)} SMs, {rate:.3f} GHz"
    )
    spread("first wave, start to first band staged (µs)", [us(b[5] - b[2]) for b in early])
    spread("later blocks, start to lists read (µs)", [us(b[3] - b[2]) for b in late])
    spread("later blocks, staging (µs)", [us(b[5] - b[3]) for b in late])
    spread("computing (µs)", [us(b[6] - b[5]) for b in work])
    spread("computing per bin row (ns)", [us(b[6] - b[5]) * 1e3 / (b[4] & 0xFFFFFFFF) for b in work])
    stage, comp, gaps, idle = [], [], [], []
    for bl in sms.values():
        bl.sort(key=lambda b: b[1])
        gaps += [(b[1] - a[7]) / 1e3 for a, b in zip(bl, bl[1:])]
        stage.append(sum(us(b[5] - b[2]) for b in bl if b[4] & 0xFFFFFFFF))
        comp.append(sum(us(b[6] - b[5]) for b in bl if b[4] & 0xFFFFFFFF))
        idle.append((t1 - bl[-1][7]) / 1e3)
    spread("per SM: start to staged, all its blocks (µs)", stage)
    spread("per SM: computing, all its blocks (µs)", comp)
    spread("per SM: idle at the end of the kernel (µs)", idle)
    spread("gap between consecutive blocks on an SM (µs)", gaps)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="7,14")
    args = ap.parse_args()
    torch.manual_seed(0)
    x = torch.randn(2, 256, 200, 304, device="cuda")
    rois = random_rois(1024, 2, 200, 304, seed=0, spatial_scale=0.25).cuda()
    buf = torch.zeros(200000 * 8, dtype=torch.int64, device="cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for size in (int(s) for s in args.sizes.split(",")):
        for back_to_back in (False, True):
            report(trace(x, rois, size, back_to_back, buf), f"{size}x{size}, {'back to back' if back_to_back else 'alone'}")


if __name__ == "__main__":
    main()
