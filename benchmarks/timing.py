"""Timing helpers: detops and torchvision in one process, on the same inputs.

CUDA cases are timed with CUDA events after a warm-up; CPU cases with perf_counter. Each case
reports the median of many runs and the ratio torchvision / detops (> 1: detops is faster).
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch


@dataclass
class Row:
    case: str
    device: str
    detops_ms: float
    torchvision_ms: Optional[float]
    # Replaces the speedup column when set (e.g. a thread-scaling ratio, which has no
    # torchvision side).
    note: Optional[str] = None

    @property
    def speedup(self) -> Optional[float]:
        if self.torchvision_ms is None:
            return None
        return self.torchvision_ms / self.detops_ms


def median_ms(fn: Callable[[], object], device: str, warmup: int = 5, runs: int = 30, max_seconds: float = 10.0) -> float:
    """Median wall time of fn() in milliseconds; CUDA work is timed with events."""
    for _ in range(warmup):
        fn()
    times: List[float] = []
    deadline = time.perf_counter() + max_seconds
    if device == "cuda":
        torch.cuda.synchronize()
        for _ in range(runs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
            if time.perf_counter() > deadline and len(times) >= 5:
                break
    else:
        for _ in range(runs):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            if time.perf_counter() > deadline and len(times) >= 3:
                break
    return statistics.median(times)


def compare(case: str, device: str, ours: Callable[[], object], theirs: Optional[Callable[[], object]], **kw) -> Row:
    row = Row(case, device, median_ms(ours, device, **kw), median_ms(theirs, device, **kw) if theirs else None)
    print(format_row(row), flush=True)
    return row


def format_ms(ms: Optional[float]) -> str:
    if ms is None:
        return "n/a"
    return f"{ms * 1e3:.0f} µs" if ms < 1 else f"{ms:.2f} ms"


def format_row(row: Row) -> str:
    if row.note is not None:
        ratio = row.note
    else:
        ratio = f"{row.speedup:.1f}x" if row.speedup is not None else "n/a"
    return f"| {row.case} | {row.device} | {format_ms(row.torchvision_ms)} | {format_ms(row.detops_ms)} | {ratio} |"


HEADER = "| case | device | torchvision | detops | speedup (tv / detops) |\n|---|---|---|---|---|"


def cpu_cores() -> tuple:
    """(logical CPUs, physical cores) this process may run on; physical is None where
    /proc/cpuinfo does not say (two logical CPUs of one core share its execution units)."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores, cpu, phys = set(), None, "0"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "processor":
                    cpu, phys = int(value), "0"
                elif key == "physical id":
                    phys = value
                elif key == "core id" and cpu in allowed:
                    cores.add((phys, value))
    except OSError:
        pass
    return len(allowed), (len(cores) or None)


def environment() -> str:
    import platform

    import torchvision

    lines = [f"- torch {torch.__version__}, torchvision {torchvision.__version__}, Python {platform.python_version()}"]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        lines.append(f"- GPU: {props.name} ({props.multi_processor_count} SMs), CUDA runtime {torch.version.cuda}")
        try:
            import subprocess

            drv = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
            ).stdout.strip()
            lines.append(f"- driver {drv}")
        except OSError:
            pass
    logical, physical = cpu_cores()
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), model)
    except OSError:
        pass
    lines.append(f"- CPU: {model}, {logical} logical CPUs, {physical or 'unknown'} physical cores")
    lines.append(f"- CPU threads used by CPU cases: {torch.get_num_threads()}")
    return "\n".join(lines)
