"""Timing helpers: detops and torchvision in one process, on the same inputs.

CUDA cases are timed with CUDA events after a warm-up; CPU cases with perf_counter. Each case
reports the median of many runs, the ratio torchvision / detops (> 1: detops is faster) and,
where one applies, the case's floor: the least time the device could take for it, worked out
from the bytes the case must move or the instructions it must issue (`byte_floor`,
`issue_floor`).
"""
from __future__ import annotations

import os
import platform
import statistics
import subprocess
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
    # Replaces the ratio column when set (e.g. a thread-scaling ratio, which has no torchvision
    # side).
    note: Optional[str] = None
    # The case's floor and how it is worked out, e.g. "37 µs (176 MB / 4.80 TB/s)".
    floor: Optional[str] = None

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


def compare(case: str, device: str, ours: Callable[[], object], theirs: Optional[Callable[[], object]],
            floor: Optional[str] = None, **kw) -> Row:
    """The row of one case: detops' and torchvision's medians (theirs None: detops alone)."""
    row = Row(case, device, median_ms(ours, device, **kw), median_ms(theirs, device, **kw) if theirs else None,
              floor=floor)
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
    return (f"| {row.case} | {format_ms(row.torchvision_ms)} | {format_ms(row.detops_ms)} | {ratio} | "
            f"{row.floor or ''} |")


HEADER = "| case | torchvision | detops | ratio (tv / detops) | floor |\n|---|---|---|---|---|"


# --- floors -------------------------------------------------------------------------------------

# Peak DRAM bandwidth (bytes/s) by GPU name, for a device whose memory clock or bus width torch
# does not report.
_PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12}


def dram_bandwidth(device: int = 0) -> Optional[float]:
    """The GPU's peak DRAM bandwidth in bytes/s: two transfers per memory clock over the whole
    bus, from the device properties; a table by name where they are missing; None without a GPU
    or for an unknown one."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(device)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2.0 * clock_khz * 1e3 * bus_bits / 8
    return next((bw for name, bw in _PEAK_BANDWIDTH.items() if name in props.name), None)


def issue_rate(device: int = 0) -> Optional[float]:
    """Thread instructions the GPU issues per second at most: 4 warp schedulers of 32 lanes per
    SM (sm_70 and later), one instruction a clock each, at the boost clock. None without a GPU."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "clock_rate", 0)
    return props.multi_processor_count * 128 * clock_khz * 1e3 if clock_khz else None


def format_floor_ms(ms: float) -> str:
    return f"{ms * 1e3:.0f} µs" if ms < 1 else f"{ms:.2f} ms"


def byte_floor(nbytes: float, bandwidth: Optional[float]) -> Optional[str]:
    """The time to move `nbytes` at `bandwidth` (bytes/s), with the arithmetic; None without a
    bandwidth."""
    if not bandwidth:
        return None
    return f"{format_floor_ms(nbytes / bandwidth * 1e3)} ({nbytes / 1e6:.0f} MB / {bandwidth / 1e12:.2f} TB/s)"


def issue_floor(what: str, instructions: float, rate: Optional[float]) -> Optional[str]:
    """The time to issue `instructions` at `rate` (per second), with the arithmetic."""
    if not rate:
        return None
    return f"{format_floor_ms(instructions / rate * 1e3)} ({what} / {rate:.2g} per s)"


# --- environment --------------------------------------------------------------------------------


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


def cpu_model() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return model


def environment() -> str:
    """Markdown lines naming what a table was measured on: the GPU (model, driver, CUDA, peak
    bandwidth), torch and torchvision, the CPU (model, CPUs, threads)."""
    import torchvision

    lines = [f"- torch {torch.__version__}, torchvision {torchvision.__version__}, Python {platform.python_version()}"]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        try:
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True).stdout.strip().splitlines()[0]
        except (OSError, IndexError):
            driver = "unknown"
        bandwidth = dram_bandwidth()
        peak = f", peak DRAM bandwidth {bandwidth / 1e12:.2f} TB/s" if bandwidth else ""
        lines.append(f"- GPU: {props.name} ({props.multi_processor_count} SMs{peak}), driver {driver}, "
                     f"CUDA runtime {torch.version.cuda}")
    logical, physical = cpu_cores()
    lines.append(f"- CPU: {cpu_model()}, {logical} logical CPUs, {physical or 'unknown'} physical cores; "
                 f"CPU cases use {torch.get_num_threads()} threads unless the case says otherwise")
    return "\n".join(lines)
