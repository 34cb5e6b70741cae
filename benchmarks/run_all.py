"""Every benchmark on the devices present, written as the tables of BENCHMARKS.md: an
environment header, then one table per device, each row detops against torchvision measured in
the same process, their ratio and the case's floor where one applies.

    python -m benchmarks.run_all [--device cpu|cuda|all] [--only nms,roi,detector] [--quick] [--out results.md]
"""
from __future__ import annotations

import argparse
import importlib
from typing import List, Optional

import torch

from benchmarks.timing import HEADER, Row, cpu_model, environment, format_row

# bench_detector times only CUDA unless quick: full-size CPU detector iterations take minutes
SUITES = {"nms": "benchmarks.bench_nms", "roi": "benchmarks.bench_roi", "detector": "benchmarks.bench_detector"}


def device_title(device: str) -> str:
    if device == "cuda":
        return f"CUDA: {torch.cuda.get_device_name(0)}"
    return f"CPU: {cpu_model()}, {torch.get_num_threads()} threads"


def table(device: str, rows: List[Row]) -> str:
    return f"### {device_title(device)}\n\n{HEADER}\n" + "".join(format_row(r) + "\n" for r in rows)


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda", "all"], default="all")
    p.add_argument("--only", help=f"comma-separated suites (default: all of {', '.join(SUITES)})")
    p.add_argument("--quick", action="store_true", help="fewer, smaller cases (a check that it runs)")
    p.add_argument("--out", help="also write the tables to this markdown file")
    a = p.parse_args(argv)
    suites = a.only.split(",") if a.only else list(SUITES)
    unknown = sorted(set(suites) - set(SUITES))
    if unknown:
        p.error(f"unknown suites {unknown}; known: {list(SUITES)}")
    devices = ["cuda", "cpu"] if a.device == "all" else [a.device]
    devices = [d for d in devices if d == "cpu" or torch.cuda.is_available()]
    command = "python -m benchmarks.run_all --device " + a.device + (f" --only {a.only}" if a.only else "") + \
        (" --quick" if a.quick else "")
    head = f"Measured with `{command}`:\n\n{environment()}\n"
    print(head, flush=True)
    tables = []
    for device in devices:
        print(f"### {device_title(device)}\n\n{HEADER}", flush=True)
        rows: List[Row] = []
        for name in suites:
            rows += importlib.import_module(SUITES[name]).run([device], quick=a.quick)
        print(flush=True)
        tables.append(table(device, rows))
    if a.out:
        with open(a.out, "w") as f:
            f.write(head + "\n" + "\n".join(tables))


if __name__ == "__main__":
    main()
