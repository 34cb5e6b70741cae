"""channels_last gradients: the layout copy the RoI ops' autograd makes for a channels_last
input, and forward+backward with a leaf map in either layout.

For each map: a plain clone (the floor a copy of those bytes reaches), torch's NCHW ->
channels_last copy (what AccumulateGrad or the next backward would otherwise do), detops'
`_to_channels_last`, and the same op on an input one value past an aligned address (on CUDA, the
kernel with one value a lane). Then roi_align and roi_pool forward+backward (7x7, sampling ratio
2, aligned) with the map a leaf, NCHW and channels_last, as `bench_roi` builds them.

On CUDA each figure is queued: the median over rounds of `--calls` calls between two events,
divided by the calls (the host's issue time hidden behind the GPU's work). On the CPU, the
median wall time of one call. "BENCHMARKS.md", "CUDA channels_last gradients", has its results.

    python -m benchmarks.channels_last_grad [--device cuda] [--dtypes fp32,bf16] [--rounds 15]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, List

import torch

import detops  # noqa: F401  (loads the ops)
from benchmarks.bench_roi import DTYPES
from detops.ops import roi_align, roi_pool
from detops.testing import random_rois

MAPS = ((2, 256, 200, 304), (8, 256, 200, 304), (2, 256, 100, 152))
to_channels_last = torch.ops.detops._to_channels_last


def timer(device: str, calls: int, rounds: int) -> Callable[[Callable[[], object]], float]:
    """A function that times fn() in µs: queued between CUDA events, or one call's wall time."""

    def cuda(fn):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        times: List[float] = []
        for _ in range(rounds):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / calls)
        return statistics.median(times)

    def cpu(fn):
        fn()
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)

    return cuda if device == "cuda" else cpu


def misaligned_copy(y: torch.Tensor) -> torch.Tensor:
    """y's values in an NCHW-contiguous tensor that starts one value past an aligned address."""
    flat = torch.empty(y.numel() + 1, dtype=y.dtype, device=y.device)
    return flat[1:].view(y.shape).copy_(y)


def copies(device: str, dtype: torch.dtype, shape, time_us) -> str:
    y = torch.randn(shape, device=device).to(dtype)
    want = y.contiguous(memory_format=torch.channels_last)
    odd = misaligned_copy(y)
    assert torch.equal(to_channels_last(y), want) and torch.equal(to_channels_last(odd), want)
    clone = time_us(lambda: y.clone())
    torch_copy = time_us(lambda: y.contiguous(memory_format=torch.channels_last))
    ours = time_us(lambda: to_channels_last(y))
    odd_us = time_us(lambda: to_channels_last(odd))
    return (f"copy {'x'.join(map(str, shape))}: clone {clone:8.1f} | torch {torch_copy:8.1f} | detops {ours:8.1f}"
            f" ({torch_copy / ours:.1f}x torch, {ours / clone:.2f}x the clone) | input one value past aligned {odd_us:8.1f}")


def forward_backward(device: str, dtype: torch.dtype, time_us) -> List[str]:
    x = torch.randn(2, 256, 200, 304, device=device).to(dtype)
    rois = random_rois(1024, 2, 200, 304, seed=0, spatial_scale=0.25).to(device=device, dtype=dtype)
    grad = torch.randn(1024, 256, 7, 7, device=device).to(dtype)
    lines = []
    for name, op in (("roi_align", lambda t: roi_align(t, rois, (7, 7), 0.25, 2, True)),
                     ("roi_pool", lambda t: roi_pool(t, rois, (7, 7), 0.25))):
        row = []
        for layout, fmt in (("NCHW", torch.contiguous_format), ("channels_last", torch.channels_last)):
            leaf = x.detach().contiguous(memory_format=fmt).requires_grad_()

            def step():
                leaf.grad = None
                op(leaf).backward(grad)

            step()
            assert leaf.grad.is_contiguous(memory_format=fmt)
            row.append(f"{layout} {time_us(step):8.1f}")
        lines.append(f"{name} fwd+bwd, leaf map 2x256x200x304: " + " | ".join(row))
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--dtypes", default="fp32,bf16", help=f"any of {','.join(DTYPES)}")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=20, help="calls queued between two events (CUDA)")
    p.add_argument("--maps", default=",".join("x".join(map(str, m)) for m in MAPS),
                   help="maps of the copy cases, BxCxHxW, comma-separated")
    a = p.parse_args()
    time_us = timer(a.device, a.calls, a.rounds)
    maps = [tuple(int(v) for v in m.split("x")) for m in a.maps.split(",")]
    print(f"torch {torch.__version__}, device {a.device}"
          + (f" ({torch.cuda.get_device_name()})" if a.device == "cuda" else f", {torch.get_num_threads()} threads")
          + "; µs, " + ("queued" if a.device == "cuda" else "one call"))
    for name in a.dtypes.split(","):
        dtype = DTYPES[name]
        for line in forward_backward(a.device, dtype, time_us):
            print(name, line, flush=True)
        for shape in maps:
            print(name, copies(a.device, dtype, shape, time_us), flush=True)


if __name__ == "__main__":
    main()
