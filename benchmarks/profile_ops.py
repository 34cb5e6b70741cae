"""Where the time of one op call goes on CUDA: torch.profiler over a few calls.

    python -m benchmarks.profile_ops [--only SUBSTRING]
"""
import argparse

import torch

import detops
from detops.testing import clustered_boxes, random_boxes, random_rois


def profile(name, fn, calls=20):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    print(f"==== {name} ({calls} calls)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


def _cases():
    for label, (b, s) in [
        ("nms 1k random", random_boxes(1000, 1)),
        ("nms 4.7k clustered", clustered_boxes(4700, 2)),
        ("nms 5k random", random_boxes(5000, 3)),
        ("nms 12k random", random_boxes(12000, 4)),
    ]:
        b, s = b.cuda(), s.cuda()
        yield label, lambda b=b, s=s: detops.ops.nms(b, s, 0.5)
    # bench_nms's batched cases: 80 classes over 20k boxes, and 8 images x 4.7k with the image
    # as the category
    b, s = (t.cuda() for t in clustered_boxes(20000, seed=8))
    lab = torch.randint(0, 80, (20000,), generator=torch.Generator().manual_seed(8)).cuda()
    yield "batched_nms 80 classes 20k", lambda: detops.ops.batched_nms(b, s, lab, 0.5)
    per = [clustered_boxes(4700, seed=30 + i) for i in range(8)]
    pb = torch.cat([p[0] for p in per]).cuda()
    ps = torch.cat([p[1] for p in per]).cuda()
    image = torch.arange(8).repeat_interleave(4700).cuda()
    yield "batched_nms 8 x 4.7k", lambda: detops.ops.batched_nms(pb, ps, image, 0.7)
    # bench_nms's nms_padded case: 8 images x 4700 clustered boxes, score > 0.05, top 1000
    parts = [clustered_boxes(4700, seed=100 + i) for i in range(8)]
    qb = torch.stack([p[0] for p in parts]).cuda()
    qs = torch.stack([p[1] for p in parts]).cuda()
    yield "nms_padded 8 x 4700", lambda: detops.ops.nms_padded(qb, qs, 0.7, 0.05, 1000)
    x = torch.randn(2, 256, 200, 304, device="cuda")
    rois = random_rois(1024, 2, 200, 304, seed=0, spatial_scale=0.25).cuda()
    yield "roi_align fwd 7x7", lambda: detops.ops.roi_align(x, rois, 7, 0.25, 2, True)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--only", default="", help="profile only the cases whose name contains this")
    a = p.parse_args()
    for label, fn in _cases():
        if a.only in label:
            profile(label, fn)


if __name__ == "__main__":
    main()
