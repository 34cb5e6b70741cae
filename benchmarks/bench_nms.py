"""NMS and batched NMS: detops vs torchvision on the same boxes.

The CUDA nms rows have a floor (`nms_floor`): the larger of the launch floor and the time to
issue the mask kernel's pair tests.
"""
from __future__ import annotations

import argparse
from typing import List, Optional

import torch
import torchvision

import detops
from benchmarks.timing import HEADER, Row, compare, issue_floor, issue_rate
from detops.testing import clustered_boxes, random_boxes


# A small CUDA nms is bound by latency: a few launches (ranking, mask, greedy pass, the count's
# copy) of 3-5 µs each and the one host sync that a variable-length result needs.
LAUNCH_FLOOR_US = 30
LAUNCH_FLOOR = "30-50 µs (a few launches of 3-5 µs and one host sync)"
# The mask kernel tests every pair of boxes once: the intersection test before any division is
# about 10 instructions a pair.
INSTRUCTIONS_PER_PAIR = 10


def nms_floor(n: int, rate: Optional[float]) -> str:
    """The floor of a CUDA nms of n boxes on a GPU that issues `rate` instructions a second:
    the pair tests' issue time (n (n - 1) / 2 pairs) where it exceeds the launch floor."""
    pairs = n * (n - 1) / 2
    arithmetic = issue_floor(f"{pairs:.2g} pairs x {INSTRUCTIONS_PER_PAIR} instructions", pairs * INSTRUCTIONS_PER_PAIR, rate)
    if arithmetic is None or pairs * INSTRUCTIONS_PER_PAIR / rate * 1e6 <= LAUNCH_FLOOR_US:
        return LAUNCH_FLOOR
    return arithmetic


def _runs(device):
    # torchvision's CPU NMS takes seconds at 20k+ boxes: fewer runs there
    return dict(runs=30, warmup=5) if device == "cuda" else dict(runs=5, warmup=1, max_seconds=5)


def _one_thread(case: str, b, s) -> Row:
    """The same NMS case with both libraries on one CPU thread (the thread count is restored)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return compare(
            case, "cpu",
            lambda: detops.ops.nms(b, s, 0.5),
            lambda: torchvision.ops.nms(b, s, 0.5),
            **_runs("cpu"),
        )
    finally:
        torch.set_num_threads(before)


def run(devices: List[str], quick: bool = False) -> List[Row]:
    rows: List[Row] = []
    for device in devices:
        cases = [
            ("nms, 1k random", random_boxes(1000, seed=1)),
            ("nms, 4.7k clustered (RPN-like)", clustered_boxes(4700, seed=2)),
            ("nms, 5k random", random_boxes(5000, seed=3)),
            ("nms, 12k random", random_boxes(12000, seed=4)),
            ("nms, 20k random", random_boxes(20000, seed=5)),
            ("nms, 30k random", random_boxes(30000, seed=6)),
        ]
        if device == "cuda" and not quick:
            cases.append(("nms, 100k random", random_boxes(100_000, seed=7, size=3000.0)))
        if quick:
            cases = cases[:3]
        rate = issue_rate() if device == "cuda" else None
        for name, (boxes, scores) in cases:
            b, s = boxes.to(device), scores.to(device)
            assert torch.equal(detops.ops.nms(b, s, 0.5).cpu().sort().values, torchvision.ops.nms(b, s, 0.5).cpu().sort().values)
            rows.append(
                compare(
                    name + ", IoU 0.5", device,
                    lambda: detops.ops.nms(b, s, 0.5),
                    lambda: torchvision.ops.nms(b, s, 0.5),
                    floor=nms_floor(b.size(0), rate) if device == "cuda" else None,
                    **_runs(device),
                )
            )
            if device == "cpu":
                rows.append(_one_thread(name + ", IoU 0.5, 1 thread", b, s))
        boxes, scores = clustered_boxes(20000, seed=8)
        labels = torch.randint(0, 80, (20000,), generator=torch.Generator().manual_seed(8))
        b, s, lab = boxes.to(device), scores.to(device), labels.to(device)
        rows.append(
            compare(
                "batched_nms, 80 classes, 20k clustered, IoU 0.5", device,
                lambda: detops.ops.batched_nms(b, s, lab, 0.5),
                lambda: torchvision.ops.batched_nms(b, s, lab, 0.5),
                **_runs(device),
            )
        )
        if device == "cuda" or not quick:
            rows.append(_per_image_case(device))
            rows.append(_padded_case(device))
    return rows


def _per_image_case(device: str) -> Row:
    """The RPN case: 8 images x 4.7k proposals, one batched_nms call with the image as the
    category, against torchvision's nms in a loop over the images."""
    per = [clustered_boxes(4700, seed=30 + i) for i in range(8)]
    boxes = torch.cat([b for b, _ in per]).to(device)
    scores = torch.cat([s for _, s in per]).to(device)
    image = torch.arange(8).repeat_interleave(4700).to(device)
    chunks = [(b.to(device), s.to(device)) for b, s in per]

    def tv_loop():
        return [torchvision.ops.nms(b, s, 0.7) for b, s in chunks]

    ours = detops.ops.batched_nms(boxes, scores, image, 0.7).cpu()
    theirs = torch.cat([k.cpu() + 4700 * i for i, k in enumerate(tv_loop())])
    assert torch.equal(ours.sort().values, theirs.sort().values)
    return compare(
        "batched_nms, 8 images x 4.7k clustered in one call vs a per-image loop, IoU 0.7", device,
        lambda: detops.ops.batched_nms(boxes, scores, image, 0.7),
        tv_loop,
        **_runs(device),
    )


def _padded_case(device: str) -> Row:
    """nms_padded on an RPN-like batch [8, 4700, 4] (score filter 0.05, top 1000 per image) vs
    the per-image loop it replaces: torchvision NMS on each image's passing boxes, cut to 1000."""
    batch, n, max_output, iou, score_thr = 8, 4700, 1000, 0.7, 0.05
    parts = [clustered_boxes(n, seed=100 + b) for b in range(batch)]
    boxes = torch.stack([p[0] for p in parts]).to(device)
    scores = torch.stack([p[1] for p in parts]).to(device)

    def torchvision_loop():
        out = torch.full((batch, max_output), -1, dtype=torch.int64, device=device)
        for b in range(batch):
            passing = torch.nonzero(scores[b] > score_thr).flatten()
            keep = passing[torchvision.ops.nms(boxes[b, passing], scores[b, passing], iou)][:max_output]
            out[b, : keep.numel()] = keep
        return out

    got = detops.ops.nms_padded(boxes, scores, iou, score_thr, max_output)[0]
    want = torchvision_loop()
    assert torch.equal(got.sort(1).values, want.sort(1).values)
    return compare(
        f"nms_padded, {batch} x {n} clustered, score > {score_thr}, top {max_output}, IoU {iou}", device,
        lambda: detops.ops.nms_padded(boxes, scores, iou, score_thr, max_output),
        torchvision_loop,
        **_runs(device),
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", choices=["cpu", "cuda", "all"], default="all")
    p.add_argument("--quick", action="store_true", help="fewer, smaller cases")
    a = p.parse_args()
    devs = ["cpu", "cuda"] if a.device == "all" else [a.device]
    devs = [d for d in devs if d == "cpu" or torch.cuda.is_available()]
    print(HEADER)
    run(devs, quick=a.quick)
