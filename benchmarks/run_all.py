"""Run every benchmark on the devices present and write one markdown table.

    python -m benchmarks.run_all [--device cpu|cuda|all] [--quick] [--out results.md]
"""
from __future__ import annotations

import argparse
import importlib

import torch

from benchmarks.timing import HEADER, environment

# bench_detector times only CUDA (its run() skips CPU unless quick: full-size CPU detector
# iterations take minutes)
SUITES = ["benchmarks.bench_nms", "benchmarks.bench_roi", "benchmarks.bench_detector"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", choices=["cpu", "cuda", "all"], default="all")
    p.add_argument("--quick", action="store_true", help="fewer, smaller cases (a check that it runs)")
    p.add_argument("--out", help="also write the table to this markdown file")
    a = p.parse_args()
    devices = ["cpu", "cuda"] if a.device == "all" else [a.device]
    devices = [d for d in devices if d == "cpu" or torch.cuda.is_available()]
    env = environment()
    print(env)
    print(HEADER)
    rows = []
    for name in SUITES:
        rows += importlib.import_module(name).run(devices, quick=a.quick)
    if a.out:
        from benchmarks.timing import format_row

        with open(a.out, "w") as f:
            f.write(env + "\n\n" + HEADER + "\n")
            f.writelines(format_row(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
