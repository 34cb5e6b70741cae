"""Where the time of one op call goes on CUDA: torch.profiler over a few calls.

    python -m benchmarks.profile_ops
"""
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


def main():
    for label, (b, s) in [
        ("nms 1k random", random_boxes(1000, 1)),
        ("nms 4.7k clustered", clustered_boxes(4700, 2)),
        ("nms 5k random", random_boxes(5000, 3)),
        ("nms 12k random", random_boxes(12000, 4)),
    ]:
        b, s = b.cuda(), s.cuda()
        profile(label, lambda: detops.ops.nms(b, s, 0.5))
    x = torch.randn(2, 256, 200, 304, device="cuda")
    rois = random_rois(1024, 2, 200, 304, seed=0, spatial_scale=0.25).cuda()
    profile("roi_align fwd 7x7", lambda: detops.ops.roi_align(x, rois, 7, 0.25, 2, True))


if __name__ == "__main__":
    main()
