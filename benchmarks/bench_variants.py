"""What each mechanism that exists only for speed buys: the library timed with it and without it,
in one process, on the benchmark inputs.

    python -m benchmarks.bench_variants [--device cpu|cuda|all] [--only NAME,...] [--quick] [--out FILE]

Mechanisms (the names --only takes):

- roi_kernel (CUDA): the shared-memory kernels of roi_align and roi_pool (plane bands for NCHW
  maps, channel tiles for roi_pool's forward), which the default choice 'auto' takes for dense
  RoIs, against 'gather', global gathers only (`detops.ops._utils.roi_kernel`). Forward,
  backward alone and forward+backward; float32, float16 and bfloat16; 7x7 and 14x14; NCHW and
  channels_last maps; bench_roi's 2x256x200x304 map with 1024 RoIs. Both choices' outputs and
  gradients are checked against torchvision's, computed in float32, before timing.
- nhwc_conversion (CUDA): roi_align's forward on an NCHW map whose samples far outnumber its
  elements (adaptive sampling ratio, 14x14 bins, bench_roi's map and RoIs), where the default
  choice converts the map to channels_last and runs the NHWC kernel, against 'tiled', the NCHW
  tiled gather on the map in place. float32, float16 and bfloat16; outputs checked against
  torchvision's first.
- cuda_graphs (CUDA): a Mask R-CNN R-50-FPN training step (bench_detector's model and inputs,
  batch 2 and 8, the model NCHW and channels_last) with the detector's CUDA graph runners at
  their settings (the backbone's `backbone_graphs`, the RPN's `target_graphs`, the box head's
  sampling), against each runner replaced by one with max_graphs=0.
- cpu_vector (CPU): roi_pool's forward (values alone and with argmax, NCHW and channels_last,
  bench_roi's CPU map) under each hand-written vector path ('auto', 'avx512', 'avx2', 'sse2';
  `detops.ops._utils.cpu_vector`) against the scalar code, at one thread and at all of torch's
  threads. Every path must give the scalar code's bits. A path the CPU lacks runs the next
  narrower one, so its row then times that one.
- cpu_output_cache (CPU): roi_align and roi_pool forward+backward on bench_roi's CPU map with
  the CPU output cache at its limit (64 MiB unless DETOPS_CPU_OUTPUT_CACHE_MB says otherwise)
  against off (`detops._C._set_cpu_output_cache(0)`), at one thread and at all threads.

The settings of a case take turns in rounds within one process (which goes first alternates),
each round timing a median over several calls (timing.median_ms: CUDA events after a warm-up,
perf_counter on the CPU); a row gives the median over the rounds of each setting, and the gain
without / with (> 1: the mechanism pays for itself there).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, ContextManager, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torchvision

import detops
from benchmarks.bench_roi import DTYPES, _inputs, fwd_bwd
from benchmarks.timing import environment, format_ms, median_ms


@dataclass
class Result:
    mechanism: str
    case: str
    with_ms: float
    without_ms: float

    @property
    def gain(self) -> float:
        return self.without_ms / self.with_ms


HEADER = "| mechanism | case | with | without | gain (without / with) |\n|---|---|---|---|---|"


def format_result(r: Result) -> str:
    return f"| {r.mechanism} | {r.case} | {format_ms(r.with_ms)} | {format_ms(r.without_ms)} | {r.gain:.2f}x |"


def emit(results: List[Result], r: Result) -> None:
    print(format_result(r), flush=True)
    results.append(r)


@dataclass
class Runs:
    """How each setting of a case is timed: `rounds` turns, each a median over `runs` calls after
    `warmup` calls."""
    rounds: int
    runs: int
    warmup: int


def alternate(fn: Callable[[], object], settings: Sequence[Callable[[], ContextManager]], device: str,
              runs: Runs) -> List[float]:
    """The median ms of fn() under each setting: in each round every setting in turn (the order
    reversed every other round), a median over runs.runs calls each; then the median of each
    setting's round medians."""
    times: List[List[float]] = [[] for _ in settings]
    for r in range(runs.rounds):
        order = list(range(len(settings)))
        for i in order if r % 2 == 0 else order[::-1]:
            with settings[i]():
                times[i].append(median_ms(fn, device, warmup=runs.warmup, runs=runs.runs, max_seconds=30.0))
    return [statistics.median(t) for t in times]


def machine_cpu_seconds() -> Optional[float]:
    """CPU seconds every process of the machine has used since boot (Linux), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    busy = sum(fields[:8]) - fields[3] - fields[4]  # all but idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def load_note(machine_before: Optional[float], own_before: float, wall_before: float) -> str:
    """What other processes used of the CPUs while the rows were timed: a threaded CPU call on a
    machine that is busy elsewhere waits for its threads' turns, and its row says so only here."""
    machine = machine_cpu_seconds()
    if machine is None or machine_before is None:
        return ""
    others = max(machine - machine_before - (own_cpu_seconds() - own_before), 0.0)
    wall = time.perf_counter() - wall_before
    return (f"Other processes used {others:.0f} CPU seconds during the {wall:.0f} s of this run "
            f"({others / wall:.2f} of {os.cpu_count()} CPUs on average).")


def thread_counts() -> List[int]:
    """One thread and all of torch's threads."""
    return sorted({1, torch.get_num_threads()})


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _threads_label(n: int) -> str:
    return f"{n} thread" + ("s" if n > 1 else "")


# --- roi_kernel (CUDA) ----------------------------------------------------------------------------


def _roi_ops(op: str, size: int) -> Tuple[Callable, Callable]:
    """(detops, torchvision) forwards of `op` at size x size, sampling ratio 2, aligned."""
    if op == "roi_align":
        return (lambda a, r: detops.ops.roi_align(a, r, size, 0.25, 2, True),
                lambda a, r: torchvision.ops.roi_align(a, r, size, 0.25, 2, True))
    return (lambda a, r: detops.ops.roi_pool(a, r, size, 0.25),
            lambda a, r: torchvision.ops.roi_pool(a, r, size, 0.25))


def _backward_alone(fn: Callable, x: torch.Tensor, rois: torch.Tensor, grad: torch.Tensor) -> Callable[[], object]:
    """The backward of one forward, as a call of its own: the forward runs once, here."""
    x = x.detach().requires_grad_()
    out = fn(x, rois)
    return lambda: torch.autograd.grad(out, x, grad, retain_graph=True)


def check_roi_choice(choice: str, ours: Callable, theirs: Callable, x: torch.Tensor, rois: torch.Tensor,
                     grad: torch.Tensor) -> None:
    """Under `choice`, detops' output and input gradient are torchvision's, computed in float32 on
    the same (rounded) values; half-precision values within 3e-2, their gradients within 0.3."""
    from detops.ops._utils import roi_kernel

    tol = 1e-4 if x.dtype == torch.float32 else 3e-2
    with roi_kernel(choice):
        out = ours(x, rois).float()
        got = fwd_bwd(ours, x, rois, grad).float()
    torch.testing.assert_close(out, theirs(x.float(), rois.float()), rtol=tol, atol=tol)
    # a gradient sums many terms: a looser bound
    want = fwd_bwd(theirs, x.float(), rois.float(), grad.float())
    torch.testing.assert_close(got, want, rtol=tol * 10, atol=tol * 10)


def roi_kernel_rows(device: str, quick: bool, results: List[Result]) -> None:
    from detops.ops._utils import roi_kernel

    if quick:
        shape, k, dtypes, sizes, runs = (1, 32, 50, 76), 64, ["fp32"], [7], Runs(2, 3, 1)
    else:
        shape, k, dtypes, sizes, runs = (2, 256, 200, 304), 1024, list(DTYPES), [7, 14], Runs(3, 15, 3)
    settings = [functools.partial(roi_kernel, "auto"), functools.partial(roi_kernel, "gather")]
    for dname in dtypes:
        x, rois = _inputs(device, DTYPES[dname], *shape, k)
        layouts = [("NCHW", x), ("channels_last", x.contiguous(memory_format=torch.channels_last))]
        for op in ("roi_align", "roi_pool"):
            for size in sizes:
                ours, theirs = _roi_ops(op, size)
                grad = torch.randn(k, shape[1], size, size, device=device, dtype=DTYPES[dname])
                for layout, xin in layouts:
                    for choice in ("auto", "gather"):
                        check_roi_choice(choice, ours, theirs, xin, rois, grad)
                    parts = {
                        "fwd": lambda: ours(xin, rois),
                        "bwd": _backward_alone(ours, xin, rois, grad),
                        "fwd+bwd": lambda: fwd_bwd(ours, xin, rois, grad),
                    }
                    for part, fn in parts.items():
                        with_ms, without_ms = alternate(fn, settings, device, runs)
                        case = f"{op} {part}, {dname}, {size}x{size}, {layout}: auto vs gather"
                        emit(results, Result("roi_kernel", case, with_ms, without_ms))


# --- nhwc_conversion (CUDA) -----------------------------------------------------------------------


def nhwc_conversion_rows(device: str, quick: bool, results: List[Result]) -> None:
    from detops.ops._utils import roi_kernel

    if quick:
        shape, k, dtypes, runs = (1, 32, 50, 76), 256, ["fp32"], Runs(2, 3, 1)
    else:
        shape, k, dtypes, runs = (2, 256, 200, 304), 1024, list(DTYPES), Runs(3, 15, 3)
    size = 14
    ours = lambda a, r: detops.ops.roi_align(a, r, size, 0.25, -1, True)  # noqa: E731
    theirs = lambda a, r: torchvision.ops.roi_align(a, r, size, 0.25, -1, True)  # noqa: E731
    settings = [functools.partial(roi_kernel, "auto"), functools.partial(roi_kernel, "tiled")]
    for dname in dtypes:
        x, rois = _inputs(device, DTYPES[dname], *shape, k)
        tol = 1e-4 if x.dtype == torch.float32 else 3e-2
        for choice in ("auto", "tiled"):
            with roi_kernel(choice):
                got = ours(x, rois).float()
            torch.testing.assert_close(got, theirs(x.float(), rois.float()), rtol=tol, atol=tol)
        with_ms, without_ms = alternate(lambda: ours(x, rois), settings, device, runs)
        case = f"roi_align fwd, {dname}, {size}x{size}, adaptive sampling, NCHW: auto (converted) vs tiled"
        emit(results, Result("nhwc_conversion", case, with_ms, without_ms))


# --- cuda_graphs (CUDA) ---------------------------------------------------------------------------


def graph_runners(model: torch.nn.Module) -> List[Tuple[object, str]]:
    """(owner, attribute name) of each CUDA graph runner of a detector: attributes of its modules
    and of the plain objects they hold (the box head's loss evaluator)."""
    from detops.modeling.cuda_graph import GraphedFunction, GraphedTraining

    runner_types = (GraphedFunction, GraphedTraining)
    found = []
    for module in model.modules():
        for name, value in vars(module).items():
            if isinstance(value, runner_types):
                found.append((module, name))
            elif not isinstance(value, (torch.nn.Module, torch.Tensor, dict, list, tuple)) and hasattr(value, "__dict__"):
                found += [(value, n) for n, v in vars(value).items() if isinstance(v, runner_types)]
    return found


@contextlib.contextmanager
def installed(places: List[Tuple[object, str]], runners: List[object]) -> Iterator[None]:
    """Within the block, runners[i] sits at places[i]; the runners found there come back after."""
    saved = [getattr(owner, name) for owner, name in places]
    try:
        for (owner, name), runner in zip(places, runners):
            setattr(owner, name, runner)
        yield
    finally:
        for (owner, name), runner in zip(places, saved):
            setattr(owner, name, runner)


def cuda_graph_rows(device: str, quick: bool, results: List[Result]) -> None:
    from benchmarks import bench_detector as bd

    height, width = (bd.QUICK_HEIGHT, bd.QUICK_WIDTH) if quick else (bd.HEIGHT, bd.WIDTH)
    batches, runs = ([1], Runs(2, 2, 1)) if quick else ([2, 8], Runs(3, 5, 2))
    tv, model = bd.build_models(device, height, width)
    del tv
    model.train()
    places = graph_runners(model)
    if not places:
        raise SystemExit("bench_variants: the detector has no CUDA graph runners to turn off")
    defaults = [getattr(owner, name) for owner, name in places]
    opt = bd._sgd(model)
    for memory_format in ("contiguous", "channels_last"):
        model.memory_format = memory_format
        for batch in batches:
            case = f"mask_rcnn R-50-FPN training, batch {batch}, {height}x{width}, fp32, {memory_format}"
            # fresh runners for each case: with their settings (graphs captured in this case), and off
            on = [type(r)(max_graphs=r.max_graphs, after=r.after, warmup=r.warmup) for r in defaults]
            off = [type(r)(max_graphs=0, after=r.after, warmup=r.warmup) for r in defaults]
            try:
                images = bd.make_images(batch, height, width, device)
                targets = bd.make_targets(batch, height, width, device)
                step = lambda: bd._train_step(model, opt, images, targets)  # noqa: E731
                with installed(places, on):
                    for _ in range(max(r.after + r.warmup for r in on) + 1):  # every graph captured
                        step()
                with_ms, without_ms = alternate(
                    step, [lambda: installed(places, on), lambda: installed(places, off)], device, runs)
            except torch.cuda.OutOfMemoryError as e:
                print(f"  {case}: out of memory: {str(e).splitlines()[0]}", flush=True)
                continue
            finally:
                images = targets = step = None
                model.zero_grad(set_to_none=True)
                gc.collect()
                torch.cuda.synchronize()
            missing = [name for (_, name), r in zip(places, on) if r.max_graphs and not r.replays]
            if missing:  # a runner that never replayed: "with" timed eager work there
                case += f" ({', '.join(missing)} not replayed)"
            on = off = None  # the graphs and their memory go
            torch.cuda.empty_cache()
            emit(results, Result("cuda_graphs", case, with_ms, without_ms))
    model.memory_format = "contiguous"


# --- cpu_vector (CPU) -----------------------------------------------------------------------------

VECTOR_CHOICES = ("auto", "avx512", "avx2", "sse2")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def check_vector_paths(name: str, fn: Callable[[], object]) -> None:
    """Stops the run unless fn() gives the scalar code's bits under every vector path."""
    from detops.ops._utils import cpu_vector

    def bits_under(choice: str) -> List[torch.Tensor]:
        with cpu_vector(choice):
            out = fn()
        return [_bits(t) for t in (out if isinstance(out, tuple) else (out,))]

    want = bits_under("scalar")
    for c in VECTOR_CHOICES:
        got = bits_under(c)
        if len(got) != len(want) or not all(torch.equal(a, b) for a, b in zip(got, want)):
            raise SystemExit(f"bench_variants: {name} under cpu_vector('{c}') differs from the scalar code")


def cpu_roi_map(quick: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """bench_roi's CPU map (2x64x100x152, 256 RoIs), or a tiny one for --quick."""
    shape = (1, 16, 50, 76, 32) if quick else (2, 64, 100, 152, 256)
    return _inputs("cpu", torch.float32, *shape)


def cpu_vector_rows(device: str, quick: bool, results: List[Result]) -> None:
    from detops.ops._utils import cpu_vector

    x, rois = cpu_roi_map(quick)
    xcl = x.contiguous(memory_format=torch.channels_last)
    values, with_argmax = torch.ops.detops._roi_pool_values, torch.ops.detops.roi_pool
    shape = "x".join(map(str, x.shape)) + f", {rois.size(0)} RoIs, 7x7"
    forwards = [
        (f"roi_pool fwd values, NCHW, {shape}", lambda: values(x, rois, 0.25, 7, 7)),
        (f"roi_pool fwd with argmax, NCHW, {shape}", lambda: with_argmax(x, rois, 0.25, 7, 7)),
        (f"roi_pool fwd values, channels_last, {shape}", lambda: values(xcl, rois, 0.25, 7, 7)),
        (f"roi_pool fwd with argmax, channels_last, {shape}", lambda: with_argmax(xcl, rois, 0.25, 7, 7)),
    ]
    choices = list(VECTOR_CHOICES) + ["scalar"]
    for name, fn in forwards:
        check_vector_paths(name, fn)
    runs = Runs(2, 2, 1) if quick else Runs(7, 10, 2)
    settings = [functools.partial(cpu_vector, c) for c in choices]
    for n in thread_counts():
        with num_threads(n):
            for name, fn in forwards:
                times = alternate(fn, settings, "cpu", runs)
                for c, t in zip(VECTOR_CHOICES, times):
                    emit(results, Result("cpu_vector", f"{name}, {_threads_label(n)}: {c} vs scalar", t, times[-1]))


# --- cpu_output_cache (CPU) -----------------------------------------------------------------------

DEFAULT_CACHE_BYTES = 64 << 20


@contextlib.contextmanager
def output_cache(nbytes: int) -> Iterator[None]:
    """Within the block the CPU output cache keeps up to `nbytes` (0: off, and emptied)."""
    from detops import _C

    before = _C._set_cpu_output_cache(nbytes)
    try:
        yield
    finally:
        _C._set_cpu_output_cache(before)


def cache_limit() -> int:
    """The output cache's limit in effect, or 64 MiB where it is off."""
    from detops import _C

    limit = _C._set_cpu_output_cache(0)
    _C._set_cpu_output_cache(limit)
    return limit or DEFAULT_CACHE_BYTES


def cpu_output_cache_rows(device: str, quick: bool, results: List[Result]) -> None:
    x, rois = cpu_roi_map(quick)
    grad = torch.randn(rois.size(0), x.size(1), 7, 7)
    shape = "x".join(map(str, x.shape)) + f", {rois.size(0)} RoIs, 7x7"
    cases = [
        (f"roi_align fwd+bwd, {shape}", lambda: fwd_bwd(lambda a, r: detops.ops.roi_align(a, r, 7, 0.25, 2, True), x, rois, grad)),
        (f"roi_pool fwd+bwd, {shape}", lambda: fwd_bwd(lambda a, r: detops.ops.roi_pool(a, r, 7, 0.25), x, rois, grad)),
    ]
    limit = cache_limit()
    runs = Runs(2, 2, 1) if quick else Runs(7, 10, 2)
    settings = [functools.partial(output_cache, limit), functools.partial(output_cache, 0)]
    for n in thread_counts():
        with num_threads(n):
            for name, fn in cases:
                with_ms, without_ms = alternate(fn, settings, "cpu", runs)
                case = f"{name}, {_threads_label(n)}: on ({limit >> 20} MiB) vs off"
                emit(results, Result("cpu_output_cache", case, with_ms, without_ms))


# --- driver -----------------------------------------------------------------------------------------

MECHANISMS: Dict[str, Tuple[str, Callable[[str, bool, List[Result]], None]]] = {
    "roi_kernel": ("cuda", roi_kernel_rows),
    "nhwc_conversion": ("cuda", nhwc_conversion_rows),
    "cuda_graphs": ("cuda", cuda_graph_rows),
    "cpu_vector": ("cpu", cpu_vector_rows),
    "cpu_output_cache": ("cpu", cpu_output_cache_rows),
}


def run(devices: Sequence[str], only: Optional[Sequence[str]] = None, quick: bool = False) -> List[Result]:
    """The rows of every mechanism named in `only` (all by default) whose device is in `devices`."""
    results: List[Result] = []
    for name, (device, rows) in MECHANISMS.items():
        if (only and name not in only) or device not in devices:
            continue
        rows(device, quick, results)
    return results


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda", "all"], default="all")
    p.add_argument("--only", help=f"comma-separated mechanisms (default: all of {', '.join(MECHANISMS)})")
    p.add_argument("--quick", action="store_true", help="tiny shapes and few runs (a check that it runs)")
    p.add_argument("--out", help="also write the table to this markdown file")
    a = p.parse_args(argv)
    only = a.only.split(",") if a.only else None
    unknown = sorted(set(only or []) - set(MECHANISMS))
    if unknown:
        p.error(f"unknown mechanisms {unknown}; known: {list(MECHANISMS)}")
    devices = ["cuda", "cpu"] if a.device == "all" else [a.device]
    if "cuda" in devices and not torch.cuda.is_available():
        print("no CUDA device: the CUDA mechanisms are left out", file=sys.stderr)
        devices.remove("cuda")
    command = "python -m benchmarks.bench_variants --device " + a.device + (f" --only {a.only}" if a.only else "") + \
        (" --quick" if a.quick else "")
    head = f"Measured with `{command}`:\n\n{environment()}\n"
    print(head + "\n" + HEADER, flush=True)
    before = machine_cpu_seconds(), own_cpu_seconds(), time.perf_counter()
    results = run(devices, only, a.quick)
    note = load_note(*before)
    print("\n" + note, flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.write(head + "\n" + HEADER + "\n" + "".join(format_result(r) + "\n" for r in results) + "\n" + note + "\n")


if __name__ == "__main__":
    main()
