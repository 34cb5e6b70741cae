"""Where the time of the CUDA RoI ops goes, on the benchmark inputs of bench_roi.

    python -m benchmarks.profile_roi            # torch.profiler: the kernels of each call
    python -m benchmarks.profile_roi --host     # host time per call against GPU time per call
    python -m benchmarks.profile_roi --host --dtypes fp32,bf16,fp16  # and 16-bit roi_align
    # the forward per call: timed alone, back to back, and replayed from a CUDA graph
    python -m benchmarks.profile_roi --graph --dtypes fp32,bf16 --sizes 7,14
    # each kernel's start and end within a forward call, back to back and alone
    python -m benchmarks.profile_roi --timeline --sizes 7,14
    # the backward alone and forward+backward, atomic and deterministic
    python -m benchmarks.profile_roi --deterministic --sizes 7,14
    # roi_pool's backward alone: GPU time per queued call, a lone call, its kernels
    python -m benchmarks.profile_roi --pool-backward --dtypes fp32,fp16,bf16 --sizes 7,14
    # roi_pool's forward with argmax (the op) and without (roi_pool when no gradient is needed)
    python -m benchmarks.profile_roi --pool-forward --dtypes fp32,fp16,bf16 --sizes 7,14
    ncu --clock-control none -k regex:'band|roi_pool|roi_align' \
        --section SpeedOfLight --section Occupancy python -m benchmarks.profile_roi --once
    # the band forward kernel per dtype and output size, one call each:
    ncu --clock-control none -k regex:roi_align_band_forward \
        --metrics gpu__time_duration.sum,smsp__inst_executed.sum \
        python -m benchmarks.profile_roi --once --only-forward --dtypes fp32,bf16,fp16 --sizes 7,14
"""
import argparse
import re
import statistics
import time

import torch
import torchvision

import detops
from benchmarks.bench_roi import DTYPES, fwd_bwd
from benchmarks.timing import median_ms
from detops.ops._utils import roi_kernel
from detops.testing import random_rois


def forward_cases(x, rois, dtypes, sizes):
    """roi_align forward through the band kernel, per dtype and output size."""
    out = {}
    for dname in dtypes:
        xd, rd = x.to(DTYPES[dname]), rois.to(DTYPES[dname])
        for size in sizes:
            out[f"roi_align fwd, band, {dname}, {size}x{size}"] = (
                "band", lambda xd=xd, rd=rd, size=size: detops.ops.roi_align(xd, rd, size, 0.25, 2, True))
    return out


def cases(only_forward=False, dtypes=("fp32",), sizes=(7,)):
    x = torch.randn(2, 256, 200, 304, device="cuda")
    rois = random_rois(1024, 2, 200, 304, seed=0, spatial_scale=0.25).cuda()
    if only_forward:
        return forward_cases(x, rois, dtypes, sizes)
    grad = torch.randn(1024, 256, 7, 7, device="cuda")
    xg = x.clone().requires_grad_()

    def fwd_bwd(fn):
        def run():
            xg.grad = None
            fn(xg).backward(grad)
        return run

    out = {}
    for kernel in ("band", "gather"):
        out[f"roi_align fwd, {kernel}"] = (kernel, lambda: detops.ops.roi_align(x, rois, 7, 0.25, 2, True))
        out[f"roi_align fwd+bwd, {kernel}"] = (kernel, fwd_bwd(lambda t: detops.ops.roi_align(t, rois, 7, 0.25, 2, True)))
        out[f"roi_pool fwd, {kernel}"] = (kernel, lambda: detops.ops.roi_pool(x, rois, 7, 0.25))
        out[f"roi_pool fwd+bwd, {kernel}"] = (kernel, fwd_bwd(lambda t: detops.ops.roi_pool(t, rois, 7, 0.25)))
    out["torchvision roi_pool fwd+bwd"] = ("auto", fwd_bwd(lambda t: torchvision.ops.roi_pool(t, rois, 7, 0.25)))
    out["torchvision roi_align fwd+bwd"] = ("auto", fwd_bwd(lambda t: torchvision.ops.roi_align(t, rois, 7, 0.25, 2, True)))
    return out


def host_cases(dtypes=("fp32",)):
    """Forward and forward+backward calls of detops and torchvision on the benchmark inputs
    (float32), then detops' roi_align in the other `dtypes` (maps and RoIs in that dtype)."""
    x = torch.randn(2, 256, 200, 304, device="cuda")
    rois = random_rois(1024, 2, 200, 304, seed=0, spatial_scale=0.25).cuda()
    xg = x.clone().requires_grad_()
    rois_g = rois.clone().requires_grad_()
    grad = torch.randn(1024, 256, 7, 7, device="cuda")

    def fwd_bwd(fn, xg=xg, grad=grad):
        return lambda: torch.autograd.grad(fn(xg), xg, grad)

    others = {}
    for dname in dtypes:
        if dname == "fp32":
            continue
        xd, rd, gd = x.to(DTYPES[dname]), rois.to(DTYPES[dname]), grad.to(DTYPES[dname])
        others[f"roi_align fwd 7x7, detops, {dname}"] = lambda xd=xd, rd=rd: detops.ops.roi_align(xd, rd, 7, 0.25, 2, True)
        others[f"roi_align fwd+bwd 7x7, detops, {dname}"] = fwd_bwd(
            lambda t, rd=rd: detops.ops.roi_align(t, rd, 7, 0.25, 2, True), xd.clone().requires_grad_(), gd
        )
    return {
        "roi_align fwd 7x7, detops": lambda: detops.ops.roi_align(x, rois, 7, 0.25, 2, True),
        # the same call through the op's autograd Function, which RoIs that need a gradient take
        "roi_align fwd 7x7, detops, RoIs that need a gradient": lambda: detops.ops.roi_align(x, rois_g, 7, 0.25, 2, True),
        "roi_align fwd 7x7, torchvision": lambda: torchvision.ops.roi_align(x, rois, 7, 0.25, 2, True),
        "roi_pool fwd 7x7, detops": lambda: detops.ops.roi_pool(x, rois, 7, 0.25),
        "roi_pool fwd 7x7, torchvision": lambda: torchvision.ops.roi_pool(x, rois, 7, 0.25),
        "roi_align fwd+bwd 7x7, detops": fwd_bwd(lambda t: detops.ops.roi_align(t, rois, 7, 0.25, 2, True)),
        "roi_align fwd+bwd 7x7, torchvision": fwd_bwd(lambda t: torchvision.ops.roi_align(t, rois, 7, 0.25, 2, True)),
        "roi_pool fwd+bwd 7x7, detops": fwd_bwd(lambda t: detops.ops.roi_pool(t, rois, 7, 0.25)),
        "roi_pool fwd+bwd 7x7, torchvision": fwd_bwd(lambda t: torchvision.ops.roi_pool(t, rois, 7, 0.25)),
        **others,
    }


def queued_times(fn, calls=20, rounds=15):
    """Per call of fn, in microseconds: the host's time to issue it while the GPU is busy with a
    long sleep kernel (so that the launches queue without waiting), and the GPU's time for the
    calls so queued, run back to back once the sleep ends (no host gaps between them)."""
    issue, gpu = [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(rounds):
        torch.cuda._sleep(200_000_000)  # about 0.1 s: longer than issuing the calls
        start.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        issue.append((time.perf_counter() - t0) / calls * 1e6)
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end) / calls * 1e3)
    return statistics.median(issue), statistics.median(gpu)


def host_overhead(calls=20, rounds=15, dtypes=("fp32",)):
    """Per call: the host's time to issue it while the GPU is busy with a long sleep kernel (so
    the launches queue without waiting), and the event time of one call timed alone, as the
    benchmarks time it. The event time includes every host gap before the GPU work starts."""
    for name, fn in host_cases(dtypes).items():
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        issue, _ = queued_times(fn, calls, rounds)
        event = median_ms(fn, "cuda", warmup=0, runs=30) * 1e3
        print(f"| {name} | host {issue:.1f} µs | event {event:.1f} µs |")


def _kernel_name(name):
    """A kernel's own name from its demangled signature."""
    found = re.findall(r"[A-Za-z_]\w*kernel\w*", name)
    return found[0] if found else name[:40]


def timeline(dtypes=("fp32",), sizes=(7,), calls=8):
    """roi_align forward per dtype and output size: each kernel's start and end (torch.profiler,
    microseconds from the call's first kernel) for calls issued back to back and for calls
    timed alone (a synchronize after each), and the gap from the previous call's last kernel."""
    x = torch.randn(2, 256, 200, 304, device="cuda")
    rois = random_rois(1024, 2, 200, 304, seed=0, spatial_scale=0.25).cuda()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    for dname in dtypes:
        xd, rd = x.to(DTYPES[dname]), rois.to(DTYPES[dname])
        for size in sizes:
            fn = lambda xd=xd, rd=rd, size=size: detops.ops.roi_align(xd, rd, size, 0.25, 2, True)
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            for mode in ("back to back", "alone"):
                with torch.profiler.profile(activities=acts) as prof:
                    for _ in range(calls):
                        fn()
                        if mode == "alone":
                            torch.cuda.synchronize()
                    torch.cuda.synchronize()
                kernels = sorted(
                    (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start,
                )
                runs, run = [], []
                for e in kernels:  # a call starts with its taps kernel
                    if "band_taps" in e.name and run:
                        runs.append(run)
                        run = []
                    run.append(e)
                runs.append(run)
                print(f"==== roi_align fwd {dname} {size}x{size}, {mode}")
                prev_end = None
                for r in runs[1:-1]:
                    t0 = r[0].time_range.start
                    spans = "; ".join(
                        f"{_kernel_name(e.name)} {e.time_range.start - t0:.1f}-{e.time_range.end - t0:.1f}" for e in r
                    )
                    gap = f", {t0 - prev_end:.1f} µs after the call before" if prev_end is not None else ""
                    print(f"  call {r[-1].time_range.end - t0:.1f} µs{gap}: {spans}")
                    prev_end = r[-1].time_range.end


def graph_times(dtypes=("fp32", "bf16"), sizes=(7, 14), calls=40, rounds=7):
    """roi_align forward per dtype and output size: the event time of one call timed alone (as
    the benchmarks time it: the host's issue time before the GPU starts counts), the time per
    call of `calls` calls issued back to back (the host runs ahead: GPU time and the gaps
    between kernels), and the time of one replay of the call captured in a CUDA graph (GPU time
    alone, from one launch)."""
    x = torch.randn(2, 256, 200, 304, device="cuda")
    rois = random_rois(1024, 2, 200, 304, seed=0, spatial_scale=0.25).cuda()
    for dname in dtypes:
        xd, rd = x.to(DTYPES[dname]), rois.to(DTYPES[dname])
        for size in sizes:
            fn = lambda: detops.ops.roi_align(xd, rd, size, 0.25, 2, True)  # noqa: E731
            alone = median_ms(fn, "cuda", runs=200)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            back_to_back = []
            for _ in range(rounds):
                start.record()
                for _ in range(calls):
                    fn()
                end.record()
                end.synchronize()
                back_to_back.append(start.elapsed_time(end) / calls)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            replay = median_ms(graph.replay, "cuda", runs=200)
            print(
                f"| roi_align fwd, {dname}, {size}x{size} | alone {alone * 1e3:.1f} µs | back to back "
                f"{statistics.median(back_to_back) * 1e3:.1f} µs | graph replay {replay * 1e3:.1f} µs |",
                flush=True,
            )


def deterministic_times(sizes=(7, 14), runs=50):
    """roi_align backward alone and forward+backward, with atomics and under
    torch.use_deterministic_algorithms(True): each timed alone (as the benchmarks time it) and
    their ratio, then the host's issue time and the GPU time of calls queued behind a sleep
    (queued_times), which tell how much of a call timed alone is the host's."""
    x = torch.randn(2, 256, 200, 304, device="cuda")
    rois = random_rois(1024, 2, 200, 304, seed=0, spatial_scale=0.25).cuda()
    for size in sizes:
        grad = torch.randn(1024, 256, size, size, device="cuda")
        backward = lambda: torch.ops.detops._roi_align_backward(  # noqa: E731
            grad, rois, 0.25, size, size, 2, 256, 200, 304, 2, True)
        both = lambda: fwd_bwd(lambda a, r: detops.ops.roi_align(a, r, size, 0.25, 2, True), x, rois, grad)  # noqa: E731
        times, queued = {}, {}
        for det in (False, True):
            torch.use_deterministic_algorithms(det)
            try:
                times[det] = (median_ms(backward, "cuda", runs=runs), median_ms(both, "cuda", runs=runs))
                queued[det] = (queued_times(backward, rounds=7), queued_times(both, rounds=7))
            finally:
                torch.use_deterministic_algorithms(False)
        (b0, f0), (b1, f1) = times[False], times[True]
        print(
            f"| roi_align {size}x{size} | backward {b0 * 1e3:.0f} µs, deterministic {b1 * 1e3:.0f} µs ({b1 / b0:.2f}x) | "
            f"forward+backward {f0 * 1e3:.0f} µs, deterministic {f1 * 1e3:.0f} µs ({f1 / f0:.2f}x) |",
            flush=True,
        )
        for i, name in enumerate(("backward", "forward+backward")):
            (h0, g0), (h1, g1) = queued[False][i], queued[True][i]
            print(
                f"|   {name}, queued | host issue {h0:.0f} µs, deterministic {h1:.0f} µs | "
                f"GPU {g0:.0f} µs, deterministic {g1:.0f} µs ({g1 / g0:.2f}x) |",
                flush=True,
            )


def _pool_inputs(dtypes, sizes, channels_last=False):
    """(dtype name, output size, map, RoIs) for each dtype and size: the benchmark inputs
    (seeded) in that dtype, the map in channels_last memory where asked."""
    torch.manual_seed(0)
    x = torch.randn(2, 256, 200, 304, device="cuda")
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    rois = random_rois(1024, 2, 200, 304, seed=0, spatial_scale=0.25).cuda()
    for dname in dtypes:
        xd, rd = x.to(DTYPES[dname]), rois.to(DTYPES[dname])
        for size in sizes:
            yield dname, size, xd, rd


def _queued_and_alone(fn):
    """fn's host issue time and GPU time per call queued behind a sleep (queued_times), and one
    call timed alone, in µs, after three warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    issue, queued = queued_times(fn, calls=20, rounds=9)
    return issue, queued, median_ms(fn, "cuda", runs=50) * 1e3


def _kernel_times(fn, calls=10):
    """The CUDA kernels of fn() and their mean time per call, in µs (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name] = kernels.get(e.name, 0.0) + e.device_time / calls
    return sorted(kernels.items(), key=lambda kv: -kv[1])


def pool_forward_times(dtypes=("fp32", "fp16", "bf16"), sizes=(7, 14), channels_last=False):
    """roi_pool's forward on the benchmark inputs, per dtype and output size: the op with argmax
    (torch.ops.detops.roi_pool, what an input that needs a gradient runs), detops.ops.roi_pool on
    an input that needs none (no argmax), and torchvision's: the GPU time per call queued behind
    a sleep (queued_times), one call timed alone, the host's issue time, and the kernels of a
    call. channels_last: the map in channels_last memory."""
    layout = ", channels_last" if channels_last else ""
    for dname, size, xd, rd in _pool_inputs(dtypes, sizes, channels_last):
        variants = {
            "with argmax": lambda: torch.ops.detops.roi_pool(xd, rd, 0.25, size, size),
            "without argmax": lambda: detops.ops.roi_pool(xd, rd, size, 0.25),
        }
        if dname != "bf16":  # torchvision's roi_pool has no bfloat16 kernel
            variants["torchvision"] = lambda: torchvision.ops.roi_pool(xd, rd, size, 0.25)
        for name, fn in variants.items():
            issue, queued, alone = _queued_and_alone(fn)
            print(f"| roi_pool fwd {name}, {dname}, {size}x{size}{layout} | queued {queued:.1f} µs | alone {alone:.1f} µs | "
                  f"host issue {issue:.1f} µs |", flush=True)
            if name != "torchvision":
                for kname, t in _kernel_times(fn):
                    print(f"|   {kname[:90]} | {t:.1f} µs |")


def pool_backward_times(dtypes=("fp32", "fp16", "bf16"), sizes=(7, 14)):
    """roi_pool's backward op alone on the benchmark inputs (the argmax of its forward), per
    dtype and output size: the GPU time per call queued behind a sleep (queued_times), one call
    timed alone, the host's issue time, and the kernels of a call (torch.profiler, mean of 10
    calls)."""
    for dname, size, xd, rd in _pool_inputs(dtypes, sizes):
        _, argmax = torch.ops.detops.roi_pool(xd, rd, 0.25, size, size)
        grad = torch.randn(argmax.shape, device="cuda").to(DTYPES[dname])
        backward = lambda: torch.ops.detops._roi_pool_backward(  # noqa: E731
            grad, rd, argmax, 0.25, size, size, 2, 256, 200, 304)
        issue, queued, alone = _queued_and_alone(backward)
        print(f"| roi_pool backward, {dname}, {size}x{size} | queued {queued:.1f} µs | alone {alone:.1f} µs | "
              f"host issue {issue:.1f} µs |", flush=True)
        for name, t in _kernel_times(backward):
            print(f"|   {name[:90]} | {t:.1f} µs |")


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--once", action="store_true", help="one call of each case (for ncu)")
    p.add_argument("--host", action="store_true", help="host issue time and event time per forward and forward+backward call")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--only-forward", action="store_true", help="only roi_align forward (band kernel) per dtype and size")
    p.add_argument("--dtypes", default="fp32", help="with --only-forward, --graph, --timeline, --host, --pool-backward or --pool-forward: fp32,bf16,fp16")
    p.add_argument("--sizes", default="7", help="with --only-forward, --graph, --timeline, --deterministic, --pool-backward or --pool-forward: output sizes, e.g. 7,14")
    p.add_argument("--graph", action="store_true", help="forward per call: alone, back to back, CUDA graph replay")
    p.add_argument("--timeline", action="store_true", help="forward: each kernel's start and end within a call, back to back and alone")
    p.add_argument("--deterministic", action="store_true", help="backward and forward+backward, atomic and deterministic")
    p.add_argument("--pool-backward", action="store_true", help="roi_pool's backward alone per dtype and size, and its kernels")
    p.add_argument("--pool-forward", action="store_true", help="roi_pool's forward with and without argmax, and torchvision's")
    p.add_argument("--channels-last", action="store_true", help="with --pool-forward: the map in channels_last memory")
    a = p.parse_args()
    if a.host:
        host_overhead(dtypes=tuple(a.dtypes.split(",")))
        return
    if a.timeline:
        timeline(tuple(a.dtypes.split(",")), tuple(int(v) for v in a.sizes.split(",")))
        return
    if a.graph:
        graph_times(tuple(a.dtypes.split(",")), tuple(int(v) for v in a.sizes.split(",")))
        return
    if a.deterministic:
        deterministic_times(tuple(int(v) for v in a.sizes.split(",")))
        return
    if a.pool_backward:
        pool_backward_times(tuple(a.dtypes.split(",")), tuple(int(v) for v in a.sizes.split(",")))
        return
    if a.pool_forward:
        pool_forward_times(tuple(a.dtypes.split(",")), tuple(int(v) for v in a.sizes.split(",")), a.channels_last)
        return
    sizes = tuple(int(v) for v in a.sizes.split(","))
    for name, (kernel, fn) in cases(a.only_forward, tuple(a.dtypes.split(",")), sizes).items():
        with roi_kernel(kernel):
            if a.once:
                fn()
                continue
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=acts) as prof:
                for _ in range(a.calls):
                    fn()
                torch.cuda.synchronize()
        print(f"==== {name} ({a.calls} calls)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
