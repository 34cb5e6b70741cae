"""Where one detector step goes on CUDA: torch.profiler over a few steps of detops and of
torchvision's maskrcnn_resnet50_fpn (same weights and inputs as bench_detector), the GPU's
busy time against the step's wall time, and the ops and kernels that take the most.

    python -m benchmarks.profile_detector [--mode training|inference] [--batch 2] [--steps 3]
    python -m benchmarks.profile_detector --syncs   # where each model waits for the GPU
"""
from __future__ import annotations

import argparse
import collections
import time
import traceback
import warnings

import torch

from benchmarks.bench_detector import HEIGHT, WIDTH, _infer, _sgd, _train_step, build_models, make_images, make_targets


def _profile(name, step, steps, rows):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3 / steps
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e3 / steps
    syncs = sum(1 for e in prof.events() if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync")) / steps
    print(f"==== {name}: {wall:.2f} ms a step under the profiler, GPU busy {busy:.2f} ms "
          f"({100 * busy / wall:.0f}%), {len(kernels) / steps:.0f} kernels and {syncs:.0f} "
          f"synchronizing copies or syncs a step")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=60))


def _syncs(name, step) -> None:
    """Runs one step under torch.cuda's sync debug mode and prints where the library code
    synchronized with the GPU (innermost detops / torchvision frame), most frequent first."""
    step()
    torch.cuda.synchronize()
    where = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack() if "/detops/" in f.filename or "/torchvision/" in f.filename]
        f = frames[-1] if frames else None
        where[f"{f.filename.split('site-packages/')[-1]}:{f.lineno}  {f.line}" if f else f"{filename}:{lineno}"] += 1

    shown = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = shown
    print(f"==== {name}: {sum(where.values())} synchronizing calls in one step")
    for loc, n in where.most_common():
        print(f"{n:5d}  {loc}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["training", "inference"], default="training")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--channels-last", action="store_true", help="detops with MODEL.MEMORY_FORMAT channels_last")
    p.add_argument("--syncs", action="store_true", help="list where each model synchronizes instead of profiling")
    a = p.parse_args()
    tv, dt = build_models("cuda", HEIGHT, WIDTH)
    if a.channels_last:
        dt.memory_format = "channels_last"
    images = make_images(a.batch, HEIGHT, WIDTH, "cuda")
    for name, model in (("torchvision", tv), ("detops", dt)):
        if a.mode == "training":
            targets = make_targets(a.batch, HEIGHT, WIDTH, "cuda")
            model.train()
            opt = _sgd(model)
            step = lambda: _train_step(model, opt, images, targets)  # noqa: E731
        else:
            model.eval()
            step = lambda: _infer(model, images)  # noqa: E731
        if a.syncs:
            _syncs(name, step)
        else:
            _profile(name, step, a.steps, a.rows)


if __name__ == "__main__":
    main()
