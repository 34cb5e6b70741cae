"""CPU RoI ops of one build at several thread counts, and what the machine gives independent work.

    python -m benchmarks.cpu_scaling --threads 1,16 --tag NAME   # medians per case, in ms
    python -m benchmarks.cpu_scaling --cases fwd,bwd --runs 300  # some cases, more calls each
    python -m benchmarks.cpu_scaling --ratio 16 --cases fwd --rounds 10  # 1 vs 16, interleaved
    python -m benchmarks.cpu_scaling --processes 1,8,16          # N one-thread processes at once
    python -m benchmarks.cpu_scaling --cores 3 --cases fwd,ref   # one thread on each core in turn

The first form times detops' CPU roi_align / roi_pool on the small map of `bench_roi`
(2x64x100x152, 256 RoIs) and on the CUDA cases' map (2x256x200x304, 1024 RoIs), 7x7 bins,
printing one line per thread count: run it once per build, alternating builds, to compare them
on one noisy machine. The case "ref" is torch's own `digamma` over 512 K floats: equal chunks
of computation on data that stays in cache, with no shared writes, about as long on one thread
as the small forward, so its scaling is what the machine gives a threaded call of that length.
The --ratio form alternates one thread and N threads in rounds within one process and prints
each round's one-thread median over its N-thread median, then the median of those ratios: a
machine's speed drifts between processes and within one, and two medians taken seconds apart
are less exposed to that drift than two taken a minute apart. The --processes form starts N
processes together, each running the small roi_align forward (or `torch.sin` with --op sin,
`torch.digamma` with --op digamma) on one thread with its own data for a few seconds, and
prints their throughput against one process: the scaling a machine gives work that shares
nothing but its caches, memory and power, which bounds what a threaded call can reach there.
The --cores form pins one thread to each core in turn and prints each core's one-thread median:
whether the one-thread baseline depends on the core the thread runs on or on when it runs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, List, Optional, Tuple

import torch

import detops
from benchmarks.bench_roi import _inputs, fwd_bwd
from benchmarks.timing import median_ms


def cases() -> List[Tuple[str, Callable[[], object], int]]:
    """(name, call, runs) for each timed case."""
    x, rois = _inputs("cpu", torch.float32, 2, 64, 100, 152, 256)
    grad = torch.randn(256, 64, 7, 7)
    xcl = x.contiguous(memory_format=torch.channels_last)
    big_x, big_rois = _inputs("cpu", torch.float32, 2, 256, 200, 304, 1024)
    big_grad = torch.randn(1024, 256, 7, 7)
    ref_in, ref_out = torch.rand(1 << 19) + 3, torch.empty(1 << 19)
    align = lambda a, r: detops.ops.roi_align(a, r, 7, 0.25, 2, True)  # noqa: E731
    backward = torch.ops.detops._roi_align_backward
    return [
        ("fwd", lambda: align(x, rois), 20),
        ("bwd", lambda: backward(grad, rois, 0.25, 7, 7, 2, 64, 100, 152, 2, True), 20),
        ("fwd+bwd", lambda: fwd_bwd(align, x, rois, grad), 20),
        ("fwd_cl", lambda: align(xcl, rois), 20),
        ("large_fwd", lambda: align(big_x, big_rois), 5),
        ("large_bwd", lambda: backward(big_grad, big_rois, 0.25, 7, 7, 2, 256, 200, 304, 2, True), 5),
        ("large_pool_fwd", lambda: detops.ops.roi_pool(big_x, big_rois, 7, 0.25), 5),
        # torch's own kernel: equal chunks of computation (16 of torch's 32 K-element grains),
        # 2 MB in and 2 MB out, no shared writes, about as long on one thread as "fwd": the
        # scaling the machine gives a threaded call of that length
        ("ref", lambda: torch.digamma(ref_in, out=ref_out), 20),
    ]


def selected_cases(names: Optional[List[str]]) -> List[Tuple[str, Callable[[], object], int]]:
    """The cases named (all of them for None), in cases()' order; unknown names stop the run."""
    timed = cases()
    if not names:
        return timed
    unknown = sorted(set(names) - {name for name, _, _ in timed})
    if unknown:
        raise SystemExit(f"cpu_scaling: unknown cases {unknown}; known: {[name for name, _, _ in timed]}")
    return [case for case in timed if case[0] in names]


def time_threads(tag: str, threads: List[int], names: Optional[List[str]] = None, runs: Optional[int] = None) -> None:
    """One line per thread count: the median of each case. names picks cases; runs replaces
    each case's number of calls at more than one thread (one thread keeps the default)."""
    timed = selected_cases(names)
    for n in threads:
        torch.set_num_threads(n)
        medians = " ".join(
            f"{name}:{median_ms(fn, 'cpu', runs=runs if runs and n > 1 else default, warmup=4):.3f}"
            for name, fn, default in timed
        )
        print(f"{tag} t={n:2d} {medians}", flush=True)


def time_ratio(tag: str, n: int, names: Optional[List[str]], rounds: int, runs: int) -> None:
    """Per case: rounds of (one-thread median, n-thread median), alternating, and their ratios."""
    for name, fn, default in selected_cases(names):
        ratios = []
        for r in range(rounds):
            torch.set_num_threads(1)
            one = median_ms(fn, "cpu", runs=default, warmup=4)
            torch.set_num_threads(n)
            many = median_ms(fn, "cpu", runs=runs, warmup=4)
            ratios.append(one / many)
            print(f"{tag} {name} round {r + 1}: 1 thread {one:.3f} ms, {n} threads {many:.3f} ms, {one / many:.2f}x", flush=True)
        print(
            f"{tag} {name}: {n} threads over 1, median {statistics.median(ratios):.2f}x "
            f"({min(ratios):.2f}-{max(ratios):.2f}x over {rounds} rounds; 0.7 N = {0.7 * n:.1f}x)",
            flush=True,
        )


def time_cores(tag: str, names: Optional[List[str]], passes: int) -> None:
    """Per case and pass: the one-thread median with the calling thread pinned to each core in
    turn. Cores that differ in speed, or a speed that moves with time on every core, set the
    one-thread baseline that --ratio divides by."""
    cores = sorted(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for p in range(passes):
            for name, fn, default in selected_cases(names):
                per_core = []
                for c in cores:
                    os.sched_setaffinity(0, {c})
                    per_core.append(median_ms(fn, "cpu", runs=default, warmup=2))
                print(
                    f"{tag} {name} pass {p + 1}, one thread on each core, ms: "
                    + " ".join(f"{c}:{v:.2f}" for c, v in zip(cores, per_core))
                    + f" (median {statistics.median(per_core):.2f}, {min(per_core):.2f}-{max(per_core):.2f})",
                    flush=True,
                )
    finally:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)


_WORKER = r"""
import sys, time, statistics, torch, detops
from benchmarks.bench_roi import _inputs
torch.set_num_threads(1)
if sys.argv[1] == "sin":
    a = torch.randn(1 << 18)
    fn = lambda: torch.sin(a, out=a)
elif sys.argv[1] == "digamma":
    a, b = torch.rand(1 << 19) + 3, torch.empty(1 << 19)
    fn = lambda: torch.digamma(a, out=b)
else:
    x, rois = _inputs("cpu", torch.float32, 2, 64, 100, 152, 256)
    fn = lambda: detops.ops.roi_align(x, rois, 7, 0.25, 2, True)
for _ in range(5):
    fn()
start = float(sys.argv[2])
while time.time() < start:
    pass
times = []
while time.time() < start + float(sys.argv[3]):
    t0 = time.perf_counter(); fn(); times.append(time.perf_counter() - t0)
print(statistics.median(times) * 1e3 if times else "nan")  # nan: it started after the window
"""


def processes(op: str, counts: List[int], seconds: float) -> None:
    base = None  # the first count's median per call
    for n in counts:
        start = time.time() + 10 + 1.0 * n  # every process has loaded and warmed up by then
        procs = [
            subprocess.Popen([sys.executable, "-c", _WORKER, op, str(start), str(seconds)], stdout=subprocess.PIPE, text=True)
            for _ in range(n)
        ]
        per_call = [float(p.communicate()[0].split()[-1]) for p in procs]
        late = sum(v != v for v in per_call)
        if late:
            raise SystemExit(f"cpu_scaling: {late} of {n} processes were not ready when the window began; rerun")
        median = statistics.median(per_call)
        base = base or median
        # the processes' calls per ms summed: one call over all of them takes 1 / rate at best
        rate = sum(1.0 / v for v in per_call)
        print(
            f"{op}: {n:2d} processes, median per call {median:.3f} ms ({min(per_call):.3f}-{max(per_call):.3f}); "
            f"throughput {n * base / (median * counts[0]):.2f}x that of {counts[0]}; "
            f"together {rate:.3f} calls per ms, as one call split over them {1.0 / rate:.3f} ms",
            flush=True,
        )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,16", help="thread counts to time the cases at")
    p.add_argument("--tag", default=detops.__file__.rsplit("/", 2)[-2], help="label of the output lines")
    p.add_argument("--cases", help="comma-separated case names (default: all), e.g. fwd,bwd")
    p.add_argument("--runs", type=int, help="calls per case at more than one thread (default: the case's own)")
    p.add_argument("--ratio", type=int, help="N: alternate 1 and N threads in rounds, printing the ratios")
    p.add_argument("--rounds", type=int, default=10, help="rounds of --ratio")
    p.add_argument("--cores", type=int, metavar="PASSES", help="time one thread pinned to each core in turn, PASSES times")
    p.add_argument("--processes", help="process counts, e.g. 1,8,16 (the first is the baseline)")
    p.add_argument("--op", choices=["roi_align", "sin", "digamma"], default="roi_align")
    p.add_argument("--seconds", type=float, default=4.0)
    a = p.parse_args()
    names = a.cases.split(",") if a.cases else None
    if a.cores:
        time_cores(a.tag, names, a.cores)
    elif a.processes:
        processes(a.op, [int(v) for v in a.processes.split(",")], a.seconds)
    elif a.ratio:
        time_ratio(a.tag, a.ratio, names, a.rounds, a.runs or 100)
    else:
        time_threads(a.tag, [int(v) for v in a.threads.split(",")], names, a.runs)
