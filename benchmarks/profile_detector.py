"""Where one detector step goes on CUDA: torch.profiler over a few steps of detops and of
torchvision's maskrcnn_resnet50_fpn (same weights and inputs as bench_detector), the GPU's
busy time against the step's wall time, and the ops and kernels that take the most.

    python -m benchmarks.profile_detector [--mode training|inference] [--batch 2] [--steps 3]
    python -m benchmarks.profile_detector --syncs   # where each model waits for the GPU
    python -m benchmarks.profile_detector --phases  # wall and GPU time of each part of a step
    python -m benchmarks.profile_detector --timeline  # when the host and the GPU reach each part

--phases synchronizes at the boundaries of the transform, backbone, RPN and RoI heads, of the
backward through the heads and through the backbone, and of the optimizer step, and reports
for each part its wall time, the GPU's busy time inside it and its kernel count. A part whose
wall time is well above its GPU time is bound by the host issuing its launches. The timing
hooks turn detops' backbone CUDA graphs off (module hooks always run eagerly), so the parts are
those of an eager step.

--timeline changes nothing in the step (no syncs inside it, no hooks: the graphs stay on). At
the start and end of each part it takes the host's clock and records a CUDA event; after the
step it prints, per mark, when the host got there and when the GPU did, both from the step's
start. Where the GPU's time is close to the host's, the GPU had run dry and waited for the host.
"""
from __future__ import annotations

import argparse
import collections
import time
import traceback
import warnings
from typing import List, Tuple

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


def _parts(model) -> List[Tuple[str, torch.nn.Module]]:
    """The top-level parts of either model's forward, in order."""
    parts = [("transform", model.transform), ("backbone", model.backbone), ("rpn", model.rpn)]
    heads = model.roi_heads
    if hasattr(heads, "box"):  # detops: CombinedROIHeads
        parts += [("box head", heads.box)] + ([("mask head", heads.mask)] if hasattr(heads, "mask") else [])
    else:
        parts.append(("roi heads", heads))
    return parts


def _phases(name, model, opt, images, targets, steps) -> None:
    """Times each part of a training step with the GPU synchronized at its boundaries."""
    handles, marks = [], []

    def enter(label):
        def pre(module, args):
            torch.cuda.synchronize()
            marks.append(torch.profiler.record_function(label))
            marks[-1].__enter__()
        return pre

    def leave(module, args, out):
        torch.cuda.synchronize()
        marks.pop().__exit__(None, None, None)

    def on_features(module, args, out):
        leave(module, args, out)
        feats = [t for t in (out.values() if isinstance(out, dict) else out) if t.requires_grad]

        def reached(grads):
            torch.cuda.synchronize()
            with torch.profiler.record_function("phase: backbone backward starts"):
                pass
        torch.autograd.graph.register_multi_grad_hook(feats, reached)

    for label, module in _parts(model):
        handles.append(module.register_forward_pre_hook(enter(f"phase: {label}")))
        handles.append(module.register_forward_hook(on_features if label == "backbone" else leave))

    def step():
        torch.cuda.synchronize()
        with torch.profiler.record_function("phase: forward"):
            losses = model(images, targets)
            loss = sum(losses.values())
            torch.cuda.synchronize()
        opt.zero_grad(set_to_none=True)
        with torch.profiler.record_function("phase: backward"):
            loss.backward()
            torch.cuda.synchronize()
        with torch.profiler.record_function("phase: optimizer"):
            opt.step()
            torch.cuda.synchronize()

    try:
        for _ in range(2):
            step()
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(steps):
                step()
    finally:
        for h in handles:
            h.remove()
    events = prof.events()
    # the GPU side of each record_function range shows up as a CUDA event too: not a kernel
    kernels = [(e.time_range.start, e.time_range.elapsed_us()) for e in events
               if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("phase: ")
               and not getattr(e, "is_user_annotation", False)]
    ranges = collections.defaultdict(list)
    for e in events:
        if e.name.startswith("phase: ") and e.device_type == torch.autograd.DeviceType.CPU:
            ranges[e.name[7:]].append((e.time_range.start, e.time_range.end))
    # the backward splits where the last feature gradient is ready
    split = sorted(s for s, _ in ranges.pop("backbone backward starts", []))
    bwd = sorted(ranges.pop("backward", []))
    if len(split) == len(bwd):
        ranges["backward: heads"] = [(s, m) for (s, _), m in zip(bwd, split)]
        ranges["backward: backbone"] = [(m, e) for (_, e), m in zip(bwd, split)]
    else:
        ranges["backward"] = bwd
    fwd = ranges.pop("forward")
    order = ["forward"] + [label for label, _ in _parts(model)] + ["backward: heads", "backward: backbone", "backward", "optimizer"]
    print(f"==== {name}: a training step in parts, the GPU synchronized at each boundary ({steps} steps)")
    print(f"{'part':<22}{'wall ms':>9}{'GPU busy ms':>13}{'busy %':>8}{'kernels':>9}")
    total = [0.0, 0.0, 0]
    for label in order:
        spans = fwd if label == "forward" else ranges.get(label)
        if not spans:
            continue
        wall = sum(e - s for s, e in spans) / 1e3 / steps
        inside = [d for t, d in kernels if any(s <= t < e for s, e in spans)]
        busy, count = sum(inside) / 1e3 / steps, len(inside) / steps
        if label != "forward":
            total = [total[0] + wall, total[1] + busy, total[2] + count]
        print(f"{label:<22}{wall:9.2f}{busy:13.2f}{100 * busy / max(wall, 1e-9):8.0f}{count:9.0f}")
    print(f"{'(parts, summed)':<22}{total[0]:9.2f}{total[1]:13.2f}{100 * total[1] / max(total[0], 1e-9):8.0f}{total[2]:9.0f}")


class _Marks:
    """(label, host time, CUDA event) at part boundaries of one step."""

    def __init__(self):
        self.marks: List[Tuple[str, float, torch.cuda.Event]] = []
        self.rows = collections.OrderedDict()

    def mark(self, label: str) -> None:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        self.marks.append((label, time.perf_counter(), e))

    def wrap(self, owner, attr: str, label: str) -> None:
        """Marks around calls of owner.attr: a module's forward, a method, or "__call__" of a
        callable object (given a subclass of its own for that)."""
        target = getattr(owner, attr)

        def wrapped(*args, **kwargs):
            self.mark(f"{label} >")
            out = target(*args, **kwargs)
            self.mark(f"{label} <")
            return out

        if attr == "__call__":
            owner.__class__ = type(type(owner).__name__, (type(owner),),
                                   {"__call__": lambda obj, *a, **k: wrapped(*a, **k)})
        else:
            setattr(owner, attr, wrapped)

    def collect(self) -> None:
        torch.cuda.synchronize()
        _, t0, e0 = self.marks[0]
        for label, t, e in self.marks:
            self.rows.setdefault(label, []).append(((t - t0) * 1e3, e0.elapsed_time(e)))
        self.marks = []

    def report(self, name: str) -> None:
        print(f"==== {name}: host and GPU time of each mark from the step's start (ms, median over steps)")
        print(f"{'mark':<34}{'host':>9}{'GPU':>9}{'GPU - host':>12}")
        for label, vals in self.rows.items():
            h = sorted(v[0] for v in vals)[len(vals) // 2]
            g = sorted(v[1] for v in vals)[len(vals) // 2]
            print(f"{label:<34}{h:9.2f}{g:9.2f}{g - h:12.2f}")


def _timeline(name, model, opt, images, targets, steps) -> None:
    """Host and GPU arrival at each part of a training step, nothing synchronized inside it."""
    marks = _Marks()
    for label, module in _parts(model):
        if label == "backbone" and "backbone_graphs" in model.__dict__:  # the graphs' runner calls the backbone
            marks.wrap(model.__dict__["backbone_graphs"], "__call__", label)
        else:
            marks.wrap(module, "forward", label)
    rpn = model.rpn
    if hasattr(rpn, "target_graphs"):  # detops
        marks.wrap(rpn.head, "forward", "  rpn head")
        marks.wrap(rpn.target_graphs, "__call__", "  rpn proposals, targets")
        marks.wrap(rpn.loss_evaluator, "losses", "  rpn loss")
        box = model.roi_heads.box
        marks.wrap(box.loss_evaluator, "subsample", "  box subsample")
        marks.wrap(box.feature_extractor, "forward", "  box features")
        marks.wrap(box.loss_evaluator, "__call__", "  box loss")
        if hasattr(model.roi_heads, "mask"):
            from detops.modeling.roi_heads.mask_head import mask_head
            from detops.modeling.utils import PendingCounts

            marks.wrap(PendingCounts, "get", "  mask counts")  # a class attribute: every instance
            marks.wrap(model.roi_heads.mask.feature_extractor, "forward", "  mask features")
            marks.wrap(mask_head, "mask_rcnn_loss", "  mask loss")

    def step():
        marks.mark("step")
        losses = model(images, targets)
        loss = sum(losses.values())
        marks.mark("forward returned")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        marks.mark("backward returned")
        opt.step()
        marks.mark("optimizer returned")

    for _ in range(5):
        step()
        marks.collect()
    marks.rows.clear()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
        marks.collect()
    print(f"==== {name}: {(time.perf_counter() - t0) * 1e3 / steps:.2f} ms a step (with a sync after each)")
    marks.report(name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["training", "inference"], default="training")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--channels-last", action="store_true", help="detops with MODEL.MEMORY_FORMAT channels_last")
    p.add_argument("--syncs", action="store_true", help="list where each model synchronizes instead of profiling")
    p.add_argument("--phases", action="store_true", help="time each part of a training step (synchronized)")
    p.add_argument("--timeline", action="store_true", help="host and GPU arrival at each part of a training step")
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
        if a.phases or a.timeline:
            if a.mode != "training":
                p.error("--phases and --timeline time a training step")
            (_timeline if a.timeline else _phases)(name, model, opt, images, targets, a.steps)
        elif a.syncs:
            _syncs(name, step)
        else:
            _profile(name, step, a.steps, a.rows)


if __name__ == "__main__":
    main()
