"""CPU RoI ops of one build at several thread counts, and what the machine gives independent work.

    python -m benchmarks.cpu_scaling --threads 1,16 --tag NAME   # medians per case, in ms
    python -m benchmarks.cpu_scaling --cases fwd,bwd --runs 300  # some cases, more calls each
    python -m benchmarks.cpu_scaling --ratio 16 --cases fwd --rounds 10  # 1 vs 16, interleaved
    python -m benchmarks.cpu_scaling --processes 1,8,16          # N one-thread processes at once
    python -m benchmarks.cpu_scaling --cores 3 --cases fwd,ref   # one thread on each core in turn
    python -m benchmarks.cpu_scaling --pairs --seconds 0.25      # which cores slow each other
    python -m benchmarks.cpu_scaling --versus 16 --seconds 0.3   # threads against processes
    python -m benchmarks.cpu_scaling --vectors avx2,auto --threads 1,16 --rounds 4  # roi_pool lanes
    python -m benchmarks.cpu_scaling --threads 1,16 --cases large_fwd+bwd,large_fwd+bwd_cl  # layouts
    python -m benchmarks.cpu_scaling --faults 16                 # fresh pages: threads against processes
    python -m benchmarks.cpu_scaling --cache-ab 64 --threads 16 --cases pool_fwd+bwd  # output cache off / on

The first form times detops' CPU roi_align / roi_pool on the small map of `bench_roi`
(2x64x100x152, 256 RoIs) and on the CUDA cases' map (2x256x200x304, 1024 RoIs), 7x7 bins,
printing one line per thread count: run it once per build, alternating builds, to compare them
on one noisy machine. Cases ending in "_cl" take the map channels_last; the "fwd+bwd" cases run
the op and its backward through autograd with the map as a leaf; "pool_argmax", "pool_bwd" and
"pool_argmax+bwd" are roi_pool's forward+backward in parts, without autograd. The case "ref"
is torch's own `digamma` over 512 K floats: equal chunks of computation on data that stays in
cache, with no shared writes, about as long on one thread as the small forward, so its scaling
is what the machine gives a threaded call of that length.
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
The --pairs form runs one pinned one-thread process per core and times every pair of cores
together against each alone (the first of --cases, default fwd): vCPUs that are two hardware
threads of one physical core slow each other down, and the guest's CPU listing may not show
which they are. The --versus form alternates, in rounds of three adjacent windows, N pinned
one-thread processes, the threaded call at N threads and the call at one thread, for each of
--cases (default fwd,ref): the threaded call's throughput over the processes', measured a
second apart, is how much of what the machine gives independent work the call gets. The
--vectors form times the roi_pool forwards (values alone and with argmax, NCHW and
channels_last; the small map, or the large one with --large) under each named `cpu_vector`
choice in turn, in rounds within one process, at each of --threads, and checks that every
choice gives the first one's bits. The --faults form times the first writes to fresh memory (a
page fault each 4 KiB page, which the OS zeroes) against writing the same memory again: by one
thread, by N threads of one process, and by one thread in each of N processes at once. The
threads of one process fault in one address space and queue behind each other there; processes
do not, so an output that faults costs a threaded call more than the processes that split it.
The --cache-ab form alternates the CPU output cache (README, DETOPS_CPU_OUTPUT_CACHE_MB) off and
on with the given MiB in rounds within one process, at each of --threads, and prints per case
the medians, the on/off ratio of each round's pair of windows and the page faults per call.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Callable, List, Optional, Tuple

import torch

import detops
from benchmarks.bench_roi import _inputs, fwd_bwd
from benchmarks.timing import median_ms

# The worker processes run `python -c` here, where `benchmarks` imports.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cases() -> List[Tuple[str, Callable[[], object], int]]:
    """(name, call, runs) for each timed case."""
    x, rois = _inputs("cpu", torch.float32, 2, 64, 100, 152, 256)
    grad = torch.randn(256, 64, 7, 7)
    xcl = x.contiguous(memory_format=torch.channels_last)
    big_x, big_rois = _inputs("cpu", torch.float32, 2, 256, 200, 304, 1024)
    big_grad = torch.randn(1024, 256, 7, 7)
    big_xcl = big_x.contiguous(memory_format=torch.channels_last)
    ref_in, ref_out = torch.rand(1 << 19) + 3, torch.empty(1 << 19)
    align = lambda a, r: detops.ops.roi_align(a, r, 7, 0.25, 2, True)  # noqa: E731
    pool = lambda a, r: detops.ops.roi_pool(a, r, 7, 0.25)  # noqa: E731
    backward = torch.ops.detops._roi_align_backward
    pool_argmax = lambda: torch.ops.detops.roi_pool(x, rois, 0.25, 7, 7)  # noqa: E731  (output, argmax)
    argmax = pool_argmax()[1]
    pool_backward = lambda a: torch.ops.detops._roi_pool_backward(  # noqa: E731
        grad, rois, a, 0.25, 7, 7, 2, 64, 100, 152)
    return [
        ("fwd", lambda: align(x, rois), 20),
        ("bwd", lambda: backward(grad, rois, 0.25, 7, 7, 2, 64, 100, 152, 2, True), 20),
        ("fwd+bwd", lambda: fwd_bwd(align, x, rois, grad), 20),
        ("fwd_cl", lambda: align(xcl, rois), 20),
        ("pool_fwd", lambda: pool(x, rois), 20),
        ("pool_fwd+bwd", lambda: fwd_bwd(pool, x, rois, grad), 20),
        # roi_pool's forward+backward in parts, without autograd: the forward with argmax; the
        # backward op on an argmax computed once; the two in turn, the backward reading the
        # argmax the forward's threads just wrote
        ("pool_argmax", pool_argmax, 20),
        ("pool_bwd", lambda: pool_backward(argmax), 20),
        ("pool_argmax+bwd", lambda: pool_backward(pool_argmax()[1]), 20),
        ("large_fwd", lambda: align(big_x, big_rois), 5),
        ("large_bwd", lambda: backward(big_grad, big_rois, 0.25, 7, 7, 2, 256, 200, 304, 2, True), 5),
        ("large_pool_fwd", lambda: pool(big_x, big_rois), 5),
        # through autograd with the input as a leaf, NCHW and channels_last (whose gradient
        # comes back channels_last: the NCHW planes copied once)
        ("fwd+bwd_cl", lambda: fwd_bwd(align, xcl, rois, grad), 20),
        ("pool_fwd+bwd_cl", lambda: fwd_bwd(pool, xcl, rois, grad), 20),
        ("large_fwd+bwd", lambda: fwd_bwd(align, big_x, big_rois, big_grad), 5),
        ("large_fwd+bwd_cl", lambda: fwd_bwd(align, big_xcl, big_rois, big_grad), 5),
        ("large_pool_fwd+bwd", lambda: fwd_bwd(pool, big_x, big_rois, big_grad), 5),
        ("large_pool_fwd+bwd_cl", lambda: fwd_bwd(pool, big_xcl, big_rois, big_grad), 5),
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
            subprocess.Popen([sys.executable, "-c", _WORKER, op, str(start), str(seconds)], stdout=subprocess.PIPE, text=True, cwd=_ROOT)
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


# A worker pinned to core sys.argv[1], running cpu_scaling's cases on one thread: for each line
# "CASE START SECONDS" on stdin it times that case from START (time.time()) for SECONDS, at
# least three calls, and prints the median per call in ms.
_CASE_WORKER = r"""
import os, sys, time, statistics, torch
os.sched_setaffinity(0, {int(sys.argv[1])})
torch.set_num_threads(1)
from benchmarks.cpu_scaling import cases
fns = {name: fn for name, fn, _ in cases()}
print("ready", *sorted(os.sched_getaffinity(0)), flush=True)
for line in sys.stdin:
    name, start, seconds = line.split()
    fn, start, seconds = fns[name], float(start), float(seconds)
    while time.time() < start - 0.002:
        time.sleep(0.001)
    while time.time() < start:
        pass
    times = []
    while time.time() < start + seconds or len(times) < 3:
        t0 = time.perf_counter(); fn(); times.append(time.perf_counter() - t0)
    print(statistics.median(times) * 1e3, flush=True)
"""


def pair_slowdowns(alone_i: float, alone_j: float, together_i: float, together_j: float) -> Tuple[float, float, float]:
    """Each core's time beside the other over its time alone, and their geometric mean."""
    fi, fj = together_i / alone_i, together_j / alone_j
    return fi, fj, (fi * fj) ** 0.5


def mutual_partners(score: dict, cores: List[int]) -> List[Tuple[int, int]]:
    """Pairs (i, j), i < j, each the other's most slowing partner by score[(min, max)]."""
    def best(c: int) -> int:
        return max((d for d in cores if d != c), key=lambda d: score[min(c, d), max(c, d)])

    return [(i, j) for i in cores for j in cores if i < j and best(i) == j and best(j) == i]


class PinnedWorkers:
    """One one-thread worker process pinned to each of `cores`, holding cases()' inputs of its
    own, each idle (blocked on its stdin) until run() gives it a case and a window."""

    def __init__(self, cores: List[int]) -> None:
        self.workers = {}
        try:
            for c in cores:
                self.workers[c] = subprocess.Popen(
                    [sys.executable, "-c", _CASE_WORKER, str(c)], stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, text=True, cwd=_ROOT)
            for c, w in self.workers.items():
                if w.stdout.readline().split() != ["ready", str(c)]:
                    raise SystemExit(f"cpu_scaling: the worker on core {c} did not start pinned to it")
        except BaseException:
            self.close()
            raise

    def run(self, case: str, group: List[int], seconds: float) -> dict:
        """The median per call of case, in ms, on each core of group, all in one window."""
        start = time.time() + 0.05
        for c in group:
            self.workers[c].stdin.write(f"{case} {start} {seconds}\n")
            self.workers[c].stdin.flush()
        return {c: float(self.workers[c].stdout.readline()) for c in group}

    def close(self) -> None:
        for w in self.workers.values():
            w.stdin.close()
        for w in self.workers.values():
            w.wait()

    def __enter__(self) -> "PinnedWorkers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def pairs(case: str, seconds: float) -> None:
    """Every pair of cores: each core's one-thread time beside the other against alone.

    Two vCPUs that are the two hardware threads of one physical core slow each other down when
    both run (they share its execution units and caches); two that are separate cores barely
    do. The guest's /proc/cpuinfo may not say which vCPUs share a core, so this measures it:
    one worker process pinned to each core, then for every pair the two together and each
    alone, `seconds` each, adjacent in time. Each core's times alone are summarized too: a core
    whose speed moves with something outside the guest shows it there."""
    import itertools

    cores = sorted(os.sched_getaffinity(0))
    with PinnedWorkers(cores) as workers:
        score, alone = {}, {c: [] for c in cores}
        for i, j in itertools.combinations(cores, 2):
            both = workers.run(case, [i, j], seconds)
            alone_i, alone_j = workers.run(case, [i], seconds), workers.run(case, [j], seconds)
            fi, fj, g = pair_slowdowns(alone_i[i], alone_j[j], both[i], both[j])
            score[i, j] = g
            alone[i].append(alone_i[i])
            alone[j].append(alone_j[j])
            print(f"{case} cores {i} and {j}: alone {alone_i[i]:.2f} / {alone_j[j]:.2f} ms, together "
                  f"{both[i]:.2f} / {both[j]:.2f} ms, slowdown x{fi:.2f} / x{fj:.2f}", flush=True)
        for c in cores:
            others = sorted((score[min(c, d), max(c, d)], d) for d in cores if d != c)
            rest = [v for v, _ in others[:-1]]
            print(f"{case} core {c}: most slowed beside core {others[-1][1]} (x{others[-1][0]:.2f}), "
                  f"median beside the others x{statistics.median(rest) if rest else float('nan'):.2f}; "
                  f"alone {min(alone[c]):.2f}-{max(alone[c]):.2f} ms, median {statistics.median(alone[c]):.2f}", flush=True)
        mutual = mutual_partners(score, cores)
        print(f"{case} mutual most-slowing pairs: " + (" ".join(f"{i}+{j}:x{score[i, j]:.2f}" for i, j in mutual) or "none"), flush=True)


def roi_pool_forwards(large: bool) -> List[Tuple[str, Callable[[], object]]]:
    """The roi_pool forwards that --vectors times, on the small map (2x64x100x152, 256 RoIs) or
    the large one (2x256x200x304, 1024 RoIs), 7x7: values alone and with argmax, NCHW and
    channels_last."""
    shape = (2, 256, 200, 304, 1024) if large else (2, 64, 100, 152, 256)
    x, rois = _inputs("cpu", torch.float32, *shape)
    xcl = x.contiguous(memory_format=torch.channels_last)
    values, with_argmax = torch.ops.detops._roi_pool_values, torch.ops.detops.roi_pool
    return [
        ("values", lambda: values(x, rois, 0.25, 7, 7)),
        ("argmax", lambda: with_argmax(x, rois, 0.25, 7, 7)),
        ("values_cl", lambda: values(xcl, rois, 0.25, 7, 7)),
        ("argmax_cl", lambda: with_argmax(xcl, rois, 0.25, 7, 7)),
    ]


def vectors(choices: List[str], threads: int, rounds: int, calls: int, large: bool = False) -> dict:
    """The roi_pool forwards under each `cpu_vector` choice: per round, each choice in turn,
    and under it `calls` rounds of one call of each forward, interleaved. Prints and returns
    the median (ms) per (forward, choice). Every choice's outputs must have the first's bits."""
    from detops.ops._utils import cpu_vector

    forwards = roi_pool_forwards(large)
    times = {(name, c): [] for name, _ in forwards for c in choices}
    first = {}
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(rounds):
            for c in choices:
                with cpu_vector(c):
                    for i in range(calls):
                        for name, fn in forwards:
                            t0 = time.perf_counter()
                            out = fn()
                            times[(name, c)].append((time.perf_counter() - t0) * 1e3)
                            if i:
                                continue
                            bits = [t.view(torch.int32) for t in (out if isinstance(out, tuple) else (out,))]
                            want = first.setdefault(name, bits)
                            if not all(torch.equal(a, b) for a, b in zip(bits, want)):
                                raise SystemExit(
                                    f"cpu_scaling: {name} under cpu_vector('{c}') differs from '{choices[0]}'"
                                )
    finally:
        torch.set_num_threads(previous)
    med = {key: statistics.median(v) for key, v in times.items()}
    shape = "large" if large else "small"
    print(f"roi_pool forwards, {shape} map, {threads} threads: " + " | ".join(
        f"{c}: " + " ".join(f"{name} {med[(name, c)]:.3f}" for name, _ in forwards)
        + f" (argmax / values {med[('argmax', c)] / med[('values', c)]:.2f},"
        f" channels_last {med[('argmax_cl', c)] / med[('values_cl', c)]:.2f})"
        for c in choices), flush=True)
    return med


def window(fn: Callable[[], object], seconds: float) -> Tuple[float, float]:
    """fn run back to back for `seconds` (at least 3 calls): the median per call in ms, and the
    process's page faults per call (minor ones: pages the OS maps on first touch)."""
    times: List[float] = []
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 3:
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return statistics.median(times), faults / len(times)


def window_ms(fn: Callable[[], object], seconds: float) -> float:
    """The median per call, in ms, of fn run back to back for `seconds` (at least 3 calls)."""
    return window(fn, seconds)[0]


def versus_round(one: float, threaded: float, processes: List[float]) -> Tuple[float, float, float, float]:
    """From one round's medians (ms per call: one thread, the threaded call, each process):
    the processes as one call split over them (ms), the threaded call's scaling over one
    thread, the processes' summed throughput over one thread, and the threaded call's
    throughput over the processes'."""
    rate = sum(1.0 / v for v in processes)
    return 1.0 / rate, one / threaded, one * rate, 1.0 / (threaded * rate)


def versus(names: Optional[List[str]], n: int, rounds: int, seconds: float) -> None:
    """Per case, rounds of three windows of `seconds`, adjacent in time, in turn first: n
    pinned one-thread processes at once, each with inputs of its own; the call at n threads;
    the call at one thread. A round's ratios come from windows a second apart, so the
    machine's drift (a core's speed moves by up to 2x within seconds on some machines) touches
    all three alike: the threaded call's throughput over the processes' is how much of what
    the machine gives independent work the call gets."""
    cores = sorted(os.sched_getaffinity(0))
    if not 1 < n <= len(cores):
        raise SystemExit(f"cpu_scaling: --versus needs 2 to {len(cores)} threads here, got {n}")
    timed = selected_cases(names)
    threads = torch.get_num_threads()
    try:
        with PinnedWorkers(cores[:n]) as workers:
            for name, fn, _ in timed:
                for t in (n, 1):
                    torch.set_num_threads(t)
                    window_ms(fn, 0.2)
                rows = []
                for r in range(rounds):
                    got, faults = {}, {}
                    for phase in [("processes", "threaded", "one")[(r + i) % 3] for i in range(3)]:
                        if phase == "processes":
                            got[phase] = list(workers.run(name, cores[:n], seconds).values())
                        else:
                            torch.set_num_threads(n if phase == "threaded" else 1)
                            got[phase], faults[phase] = window(fn, seconds)
                        time.sleep(0.05)  # the threaded call's idle threads stop spinning
                    split, scaling, procs, share = versus_round(got["one"], got["threaded"], got["processes"])
                    rows.append((scaling, procs, share))
                    print(f"{name} round {r + 1}: 1 thread {got['one']:.3f} ms, {n} threads {got['threaded']:.3f} ms, "
                          f"{n} processes as one call split over them {split:.3f} ms; threads {scaling:.2f}x, "
                          f"processes {procs:.2f}x one thread; threads get {share:.2f} of the processes' throughput; "
                          f"page faults a call {faults['threaded']:.0f} threaded, {faults['one']:.0f} one thread",
                          flush=True)
                med = [statistics.median(v) for v in zip(*rows)]
                lo, hi = [min(v) for v in zip(*rows)], [max(v) for v in zip(*rows)]
                print(f"{name}: {n} threads {med[0]:.2f}x one thread ({lo[0]:.2f}-{hi[0]:.2f}), {n} processes "
                      f"{med[1]:.2f}x ({lo[1]:.2f}-{hi[1]:.2f}); the threaded call gets {med[2]:.2f} of the "
                      f"processes' throughput ({lo[2]:.2f}-{hi[2]:.2f}); medians over {rounds} rounds; "
                      f"0.7 N = {0.7 * n:.1f}x", flush=True)
    finally:
        torch.set_num_threads(threads)


def fresh_pages(mib: int, reps: int) -> Tuple[float, float]:
    """Medians over reps fresh anonymous mappings of `mib` MiB, each filled with torch's fill_
    at the current thread count, then filled again: ms of the first fill and of the second. The
    first maps every page (a fault that zeroes it), the second only writes."""
    import mmap

    first, again = [], []
    for _ in range(reps):
        m = mmap.mmap(-1, mib << 20)
        t = torch.frombuffer(m, dtype=torch.float32)
        t0 = time.perf_counter()
        t.fill_(1.0)
        t1 = time.perf_counter()
        t.fill_(2.0)
        first.append((t1 - t0) * 1e3)
        again.append((time.perf_counter() - t1) * 1e3)
        del t
        m.close()
    return statistics.median(first), statistics.median(again)


def page_us(mib: int, first_ms: float, again_ms: float) -> float:
    """What mapping one 4 KiB page added to a fill of `mib` MiB, in us of wall time."""
    return max(first_ms - again_ms, 0.0) * 1e3 / ((mib << 20) // 4096)


# One process of the --faults form: from START (time.time()) it times fresh_pages on one thread
# and prints the us a page added.
_FAULT_WORKER = r"""
import sys, time, torch
torch.set_num_threads(1)
from benchmarks.cpu_scaling import fresh_pages, page_us
mib, start, reps = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
while time.time() < start:
    time.sleep(0.001)
print(page_us(mib, *fresh_pages(mib, reps)), flush=True)
"""


def faults(n: int, mib: int = 8, reps: int = 15, lead: float = 5.0) -> None:
    """First writes to fresh memory: one thread, n threads of one process, and one thread in
    each of n processes at once, each on its own `mib` MiB mappings; per page, the us of wall
    time the faults added and the us of thread time (wall times threads), and the pages mapped
    per us together. The processes start timing together `lead` seconds after they start."""
    threads = torch.get_num_threads()
    try:
        for t in (1, n):
            torch.set_num_threads(t)
            fresh_pages(mib, 2)
            first, again = fresh_pages(mib, reps)
            us = page_us(mib, first, again)
            print(f"fresh pages, {t:2d} thread{'s' if t > 1 else ''} of one process: first fill of {mib} MiB "
                  f"{first:.3f} ms, again {again:.3f} ms; {us:.3f} us a page ({us * t:.3f} us of thread "
                  f"time), {1 / us if us else float('inf'):.2f} pages a us", flush=True)
    finally:
        torch.set_num_threads(threads)
    for p in (1, n):
        start = time.time() + lead + 0.2 * p  # every process has loaded torch by then
        procs = [subprocess.Popen([sys.executable, "-c", _FAULT_WORKER, str(mib), str(start), str(reps)],
                                  stdout=subprocess.PIPE, text=True, cwd=_ROOT) for _ in range(p)]
        per_page = [float(q.communicate()[0].split()[-1]) for q in procs]
        if any(q.returncode for q in procs):
            raise SystemExit("cpu_scaling: a --faults process failed")
        us = statistics.median(per_page)
        print(f"fresh pages, {p:2d} process{'es' if p > 1 else ''} at once, one thread each: {us:.3f} us a "
              f"page each ({min(per_page):.3f}-{max(per_page):.3f}), "
              f"{sum(1 / v for v in per_page if v):.2f} pages a us together", flush=True)


def cache_ab(names: Optional[List[str]], threads: int, rounds: int, seconds: float, mib: int) -> None:
    """Per case, `rounds` pairs of windows of `seconds` within one process, the CPU output cache
    off and on with `mib` MiB (off first in odd rounds, on first in even ones): each round's
    on/off ratio is taken a moment apart, so the machine's drift between processes does not
    enter it. Restores the thread count and the cache's limit (emptying it)."""
    from detops import _C

    if mib <= 0:
        raise SystemExit(f"cpu_scaling: --cache-ab needs a positive MiB, got {mib}")
    timed = selected_cases(names)
    before, limit = torch.get_num_threads(), _C._set_cpu_output_cache(0)
    try:
        torch.set_num_threads(threads)
        for name, fn, _ in timed:
            got = {0: [], mib: []}
            calls_faults = {0: [], mib: []}
            ratios = []
            for r in range(rounds):
                for v in ((0, mib) if r % 2 == 0 else (mib, 0)):
                    _C._set_cpu_output_cache(v << 20)
                    window_ms(fn, min(seconds, 0.05))  # the cache filled, the threads awake
                    ms, f = window(fn, seconds)
                    got[v].append(ms)
                    calls_faults[v].append(f)
                ratios.append(got[mib][-1] / got[0][-1])
            med = {v: statistics.median(got[v]) for v in got}
            print(f"{name} {threads} thread{'s' if threads > 1 else ''}: cache off {med[0]:.3f} ms "
                  f"({min(got[0]):.3f}-{max(got[0]):.3f}), on ({mib} MiB) {med[mib]:.3f} ms "
                  f"({min(got[mib]):.3f}-{max(got[mib]):.3f}); on / off {statistics.median(ratios):.3f} "
                  f"({min(ratios):.3f}-{max(ratios):.3f}), on faster in {sum(x < 1 for x in ratios)} of "
                  f"{rounds} rounds; page faults a call {statistics.median(calls_faults[0]):.0f} off, "
                  f"{statistics.median(calls_faults[mib]):.0f} on", flush=True)
    finally:
        torch.set_num_threads(before)
        _C._set_cpu_output_cache(0)
        _C._set_cpu_output_cache(limit)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,16", help="thread counts to time the cases at")
    p.add_argument("--tag", default=detops.__file__.rsplit("/", 2)[-2], help="label of the output lines")
    p.add_argument("--cases", help="comma-separated case names (default: all), e.g. fwd,bwd")
    p.add_argument("--runs", type=int, help="calls per case at more than one thread (default: the case's own)")
    p.add_argument("--ratio", type=int, help="N: alternate 1 and N threads in rounds, printing the ratios")
    p.add_argument("--rounds", type=int, default=10, help="rounds of --ratio and --versus")
    p.add_argument("--cores", type=int, metavar="PASSES", help="time one thread pinned to each core in turn, PASSES times")
    p.add_argument("--processes", help="process counts, e.g. 1,8,16 (the first is the baseline)")
    p.add_argument("--pairs", action="store_true", help="every pair of cores: each one's time beside the other against alone")
    p.add_argument("--versus", type=int, metavar="N", help="rounds of N processes, N threads and one thread, adjacent")
    p.add_argument("--op", choices=["roi_align", "sin", "digamma"], default="roi_align", help="what --processes runs")
    p.add_argument("--seconds", type=float, help="window of --processes, --pairs and --versus (default 4), of --cache-ab (0.25)")
    p.add_argument("--vectors", help="cpu_vector choices to time the roi_pool forwards under, e.g. avx2,auto")
    p.add_argument("--large", action="store_true", help="--vectors on the large map")
    p.add_argument("--faults", type=int, metavar="N", help="fresh pages' cost: 1 and N threads, 1 and N processes")
    p.add_argument("--cache-ab", type=int, metavar="MIB", help="the CPU output cache off and on with MIB MiB, alternating")
    a = p.parse_args()
    names = a.cases.split(",") if a.cases else None
    if a.vectors:
        for n in [int(v) for v in a.threads.split(",")]:
            vectors(a.vectors.split(","), n, a.rounds, a.runs or 15, a.large)
    elif a.faults:
        faults(a.faults)
    elif a.cache_ab:
        for n in [int(v) for v in a.threads.split(",")]:
            cache_ab(names, n, a.rounds, a.seconds or 0.25, a.cache_ab)
    elif a.cores:
        time_cores(a.tag, names, a.cores)
    elif a.versus:
        versus(names or ["fwd", "ref"], a.versus, a.rounds, a.seconds or 4.0)
    elif a.pairs:
        pairs(names[0] if names else "fwd", a.seconds or 4.0)
    elif a.processes:
        processes(a.op, [int(v) for v in a.processes.split(",")], a.seconds or 4.0)
    elif a.ratio:
        time_ratio(a.tag, a.ratio, names, a.rounds, a.runs or 100)
    else:
        time_threads(a.tag, [int(v) for v in a.threads.split(",")], names, a.runs)
