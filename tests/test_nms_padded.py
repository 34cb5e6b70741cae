"""detops.ops.nms_padded: fixed-shape batched NMS against torchvision and the reference, and
its CUDA-graph capture, sync-freedom, export and compile."""
import math

import pytest
import torch
import torchvision

import detops
from detops.ops import nms, nms_padded
from detops.reference import nms_padded as ref
from detops.testing import clustered_boxes, random_boxes
from tests.conftest import DEVICES
from tests.test_nms import NEAR_TIE_THRESHOLDS, _separate_pairs

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def batch_of(kind, batch, n, seed, dtype=torch.float32):
    gen = random_boxes if kind == "random" else clustered_boxes
    parts = [gen(n, seed=seed + b, dtype=dtype) for b in range(batch)]
    if batch == 0:
        return torch.empty(0, n, 4, dtype=dtype), torch.empty(0, n, dtype=dtype)
    return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])


def torchvision_padded(boxes, scores, iou_threshold, score_threshold, max_output):
    """Per image: torchvision NMS of the boxes with score > score_threshold, mapped back to
    positions in N and cut to max_output. float16 / bfloat16 inputs go to torchvision as
    float32 (exactly representable), the precision detops computes their IoU in."""
    out = torch.full((boxes.size(0), max_output), -1, dtype=torch.int64)
    counts = torch.zeros(boxes.size(0), dtype=torch.int64)
    for b in range(boxes.size(0)):
        bx, sc = boxes[b].cpu(), scores[b].cpu()
        if bx.dtype in (torch.float16, torch.bfloat16):
            bx, sc = bx.float(), sc.float()
        passing = torch.nonzero(ref.score_mask(sc, score_threshold)).flatten()
        keep = passing[torchvision.ops.nms(bx[passing], sc[passing], iou_threshold)][:max_output]
        out[b, : keep.numel()] = keep
        counts[b] = keep.numel()
    return out, counts


def check(got, expected):
    (idx, cnt), (e_idx, e_cnt) = got, expected
    assert idx.dtype == torch.int64 and cnt.dtype == torch.int64
    assert idx.shape == e_idx.shape and cnt.shape == e_cnt.shape
    assert torch.equal(cnt.cpu(), e_cnt.cpu())
    assert torch.equal(idx.cpu(), e_idx.cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["random", "clustered"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_torchvision_and_reference(device, kind, dtype):
    boxes, scores = batch_of(kind, 3, 700, seed=10, dtype=dtype)
    for iou, score_thr, max_output in [(0.5, float("-inf"), 100), (0.3, 0.4, 1000), (0.7, 0.2, 5), (0.5, 0.5, 0)]:
        got = nms_padded(boxes.to(device), scores.to(device), iou, score_thr, max_output)
        assert got[0].device == boxes.to(device).device and got[1].device == got[0].device
        check(got, torchvision_padded(boxes, scores, iou, score_thr, max_output))
        check(got, ref.nms_padded(boxes, scores, iou, score_thr, max_output))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [1, 63, 64, 65, 130, 2000])
def test_sizes_around_tiles(device, n):
    boxes, scores = batch_of("clustered", 2, n, seed=n)
    for max_output in (1, 64, 65, n, n + 7):
        got = nms_padded(boxes.to(device), scores.to(device), 0.5, 0.1, max_output)
        check(got, torchvision_padded(boxes, scores, 0.5, 0.1, max_output))


@pytest.mark.parametrize("device", DEVICES)
def test_row_equals_nms_cut_to_max_output(device):
    boxes, scores = batch_of("clustered", 4, 1500, seed=3)
    idx, cnt = nms_padded(boxes.to(device), scores.to(device), 0.6, max_output=10_000)
    for b in range(4):
        keep = nms(boxes[b], scores[b], 0.6)
        assert cnt[b].item() == keep.numel()
        assert torch.equal(idx[b, : keep.numel()].cpu(), keep)
        assert bool((idx[b, keep.numel():] == -1).all())
    idx5, cnt5 = nms_padded(boxes.to(device), scores.to(device), 0.6, max_output=5)
    assert torch.equal(idx5, idx[:, :5]) and cnt5.tolist() == [5] * 4


@pytest.mark.parametrize("device", DEVICES)
def test_suppression_across_tiles(device):
    # 64 disjoint base boxes, each copied (jittered) to random ranks over seven 64-box tiles: a
    # copy is suppressed by the best copy of its base box, which may lie in any earlier tile, the
    # one just before included, or in its own tile.
    g = torch.Generator().manual_seed(0)
    corner = torch.arange(64, dtype=torch.float32)
    x1, y1 = (corner % 8) * 20, torch.div(corner, 8, rounding_mode="floor") * 20
    which = torch.randint(0, 64, (2, 7 * 64), generator=g)
    boxes = torch.stack([x1[which], y1[which], x1[which] + 10, y1[which] + 10], -1)
    boxes = boxes + torch.rand(boxes.shape, generator=g) * 0.5  # IoU of two copies > 0.68
    scores = torch.rand(2, 7 * 64, generator=g)
    for max_output in (10, 64, 1000):
        got = nms_padded(boxes.to(device), scores.to(device), 0.5, 0.0, max_output)
        check(got, torchvision_padded(boxes, scores, 0.5, 0.0, max_output))
        check(got, ref.nms_padded(boxes, scores, 0.5, 0.0, max_output))
    assert got[1].tolist() == [len(set(which[b].tolist())) for b in range(2)]


@pytest.mark.parametrize("device", DEVICES)
def test_ties_keep_original_order(device):
    boxes, _ = batch_of("random", 2, 600, seed=3)
    scores = torch.randint(0, 4, (2, 600)).float()  # many equal scores
    scores[1, ::2] = -0.0  # -0 and +0 are equal scores
    scores[1, 1::4] = 0.0
    got = nms_padded(boxes.to(device), scores.to(device), 0.5, -1.0, 600)
    check(got, ref.nms_padded(boxes, scores, 0.5, -1.0, 600))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_shapes(device, dtype):
    for batch, n, max_output in [(0, 5, 10), (3, 0, 10), (0, 0, 0), (2, 5, 0)]:
        boxes = torch.rand(batch, n, 4, dtype=dtype, device=device)
        scores = torch.rand(batch, n, dtype=dtype, device=device)
        idx, cnt = nms_padded(boxes, scores, 0.5, max_output=max_output)
        assert idx.shape == (batch, max_output) and cnt.shape == (batch,)
        assert idx.dtype == torch.int64 and cnt.dtype == torch.int64 and idx.device.type == device
        assert bool((idx == -1).all()) and bool((cnt == 0).all())


@pytest.mark.parametrize("device", DEVICES)
def test_all_filtered_and_partly_filtered(device):
    boxes, scores = batch_of("random", 3, 300, seed=4)
    scores[1] = 0.1  # row 1: nothing passes 0.5
    scores[2, 100:] = float("-inf")  # row 2: -inf marks padding, dropped by the default threshold
    scores[2, :50] = float("nan")
    idx, cnt = nms_padded(boxes.to(device), scores.to(device), 0.5, 0.5, 50)
    assert cnt[1].item() == 0 and bool((idx[1] == -1).all())
    check((idx, cnt), torchvision_padded(boxes, scores, 0.5, 0.5, 50))
    idx, cnt = nms_padded(boxes.to(device), scores.to(device), 0.5, max_output=300)
    assert bool(((idx[2] >= 50) & (idx[2] < 100) | (idx[2] == -1)).all())
    check((idx, cnt), ref.nms_padded(boxes, scores, 0.5, float("-inf"), 300))
    # +inf threshold: nothing passes
    idx, cnt = nms_padded(boxes.to(device), scores.to(device), 0.5, math.inf, 7)
    assert bool((idx == -1).all()) and bool((cnt == 0).all())


@pytest.mark.parametrize("device", DEVICES)
def test_score_threshold_is_strict_and_exact(device):
    boxes = torch.tensor([[[0.0, 0, 10, 10], [20, 20, 30, 30], [40, 40, 50, 50]]], device=device)
    scores = torch.tensor([[0.5, 0.25, 0.75]], device=device)
    idx, cnt = nms_padded(boxes, scores, 0.5, 0.5, 3)
    assert idx.tolist() == [[2, -1, -1]] and cnt.tolist() == [1]
    # 0.1 is not a float32: float32(0.1) > 0.1 exactly, so it passes a threshold of 0.1
    s = torch.tensor([[0.1, 0.1, 0.1]], dtype=torch.float32, device=device)
    assert nms_padded(boxes, s, 0.5, 0.1, 3)[1].tolist() == [3 if float(s[0, 0]) > 0.1 else 0]
    h = torch.tensor([[0.1, 0.2, 0.3]], dtype=torch.float16, device=device)
    expected = [int(v > 0.2) for v in h[0].double().tolist()]
    assert nms_padded(boxes.half(), h, 0.5, 0.2, 3)[1].item() == sum(expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", [1.0, 1e-12, 2.0**-29, 2.0**29])
def test_iou_ties_and_near_ties_decided_exactly(device, scale):
    # The CUDA mask kernel decides intersecting pairs of plain boxes without a division
    # (csrc/cuda/nms_tile.cuh); pairs a few rounding steps from the threshold, and boxes
    # outside the plain areas (scale 1e-12; at 2^-29 and 2^29 the smallest or largest boxes),
    # must be decided as the division decides them. Both images hold the same pairs, the
    # second in reverse order.
    boxes, iou = _separate_pairs(seed=6, scale=scale)
    count = iou.numel()
    scores = torch.cat([torch.ones(count), torch.full((count,), 0.5)])
    flip = torch.arange(2 * count - 1, -1, -1)
    batch_boxes = torch.stack([boxes, boxes[flip]]).to(device)
    batch_scores = torch.stack([scores, scores[flip]]).to(device)
    for t in NEAR_TIE_THRESHOLDS + [0.25, 0.9]:
        idx, cnt = nms_padded(batch_boxes, batch_scores, t, 0.0, 2 * count)
        suppressed = (iou.double() > t).nonzero().flatten() + count
        keep = sorted(set(range(2 * count)) - set(suppressed.tolist()))
        assert cnt.tolist() == [len(keep)] * 2, t
        assert sorted(idx[0, : len(keep)].tolist()) == keep, t
        assert sorted(idx[1, : len(keep)].tolist()) == sorted(2 * count - 1 - k for k in keep), t


@pytest.mark.parametrize("device", DEVICES)
def test_nan_and_inf_like_nms(device):
    nan, inf = math.nan, math.inf
    boxes = torch.tensor(
        [[0.0, 0.0, 10.0, 10.0], [0.0, 0.0, 10.0, 10.0], [0.0, 0.0, nan, 10.0], [1.0, 1.0, 10.0, 10.0],
         [0.0, 0.0, inf, inf], [0.0, 0.0, 10.0, 10.0]],
        device=device,
    )
    scores = torch.tensor([0.9, nan, 0.95, 0.8, 0.5, 0.1], device=device)
    idx, cnt = nms_padded(boxes[None], scores[None], 0.5, max_output=6)
    assert idx.tolist() == [[2, 0, 4, -1, -1, -1]] and cnt.tolist() == [3]


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous(device):
    boxes, scores = batch_of("clustered", 3, 500, seed=6)
    boxes_t = boxes.permute(2, 0, 1).contiguous().permute(1, 2, 0)
    scores_t = scores.t().contiguous().t()
    assert not boxes_t.is_contiguous() and not scores_t.is_contiguous()
    got = nms_padded(boxes_t.to(device), scores_t.to(device), 0.5, 0.2, 200)
    check(got, nms_padded(boxes, scores, 0.5, 0.2, 200))


def test_maskrcnn_style_entry_and_cpp_defaults():
    boxes, scores = batch_of("random", 2, 300, seed=1)
    check(detops._C.nms_padded(boxes, scores, 0.5), nms_padded(boxes, scores, 0.5))


BAD_INPUTS = [
    ("2-D boxes", lambda: (torch.rand(7, 4), torch.rand(7)), {}, r"boxes must be a \[B, N, 4\] tensor, got \[7, 4\]"),
    ("[B, N, 5] boxes", lambda: (torch.rand(2, 7, 5), torch.rand(2, 7)), {}, r"boxes must be a \[B, N, 4\] tensor"),
    ("1-D scores", lambda: (torch.rand(2, 7, 4), torch.rand(7)), {}, r"scores must be a \[B, N\] tensor, got \[7\]"),
    ("different N", lambda: (torch.rand(2, 7, 4), torch.rand(2, 6)), {}, r"boxes \[B, N, 4\] and scores \[B, N\] must agree in B and N, got boxes \[2, 7, 4\] and scores \[2, 6\]"),
    ("different B", lambda: (torch.rand(2, 7, 4), torch.rand(3, 7)), {}, r"boxes \[B, N, 4\] and scores \[B, N\] must agree in B and N"),
    ("int boxes", lambda: (torch.randint(0, 9, (1, 7, 4)), torch.rand(1, 7)), {}, "boxes must be a float32"),
    ("bool scores", lambda: (torch.rand(1, 7, 4), torch.rand(1, 7) > 0.5), {}, "scores must be a float32"),
    ("negative max_output", lambda: (torch.rand(1, 7, 4), torch.rand(1, 7)), {"max_output": -1}, "max_output must be >= 0, got -1"),
    ("nan iou", lambda: (torch.rand(1, 7, 4), torch.rand(1, 7)), {"iou_threshold": math.nan}, "iou_threshold must be a finite number"),
    ("inf iou", lambda: (torch.rand(1, 7, 4), torch.rand(1, 7)), {"iou_threshold": math.inf}, "iou_threshold must be a finite number"),
    ("nan score_threshold", lambda: (torch.rand(1, 7, 4), torch.rand(1, 7)), {"score_threshold": math.nan}, "score_threshold must be a number"),
]


@pytest.mark.parametrize("name,make,kwargs,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input(name, make, kwargs, message):
    boxes, scores = make()
    args = dict(iou_threshold=0.5)
    args.update(kwargs)
    with pytest.raises(RuntimeError, match="detops.nms_padded: " + message):
        nms_padded(boxes, scores, **args)


def test_opcheck():
    boxes, scores = batch_of("clustered", 2, 200, seed=0)
    torch.library.opcheck(torch.ops.detops.nms_padded, (boxes, scores, 0.5, 0.1, 50))
    torch.library.opcheck(torch.ops.detops.nms_padded, (boxes, scores, 0.5, float("-inf"), 300))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device):
    torch._dynamo.reset()

    def postprocess(boxes, scores):
        idx, cnt = nms_padded(boxes, scores, 0.5, 0.05, 64)
        valid = idx >= 0
        picked = torch.gather(boxes, 1, idx.clamp(min=0)[..., None].expand(-1, -1, 4))
        return picked * valid[..., None], cnt

    boxes, scores = batch_of("clustered", 3, 300, seed=1)
    args = [t.to(device) for t in (boxes, scores)]
    compiled = torch.compile(postprocess, fullgraph=True, backend="eager" if device == "cpu" else "inductor")
    got, want = compiled(*args), postprocess(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_export_dynamic_batch_and_box_count():
    class Post(torch.nn.Module):
        def forward(self, boxes, scores):
            return nms_padded(boxes, scores, 0.5, 0.1, 40)

    boxes, scores = batch_of("clustered", 2, 300, seed=2)
    b, n = torch.export.Dim("b", min=1), torch.export.Dim("n", min=2)
    ep = torch.export.export(Post(), (boxes, scores), dynamic_shapes=({0: b, 1: n}, {0: b, 1: n}))
    assert any("detops.nms_padded" in str(node.target) for node in ep.graph.nodes)
    for batch, size in ((1, 50), (2, 300), (5, 900)):
        bx, sc = batch_of("clustered", batch, size, seed=size)
        got, want = ep.module()(bx, sc), Post()(bx, sc)
        assert got[0].shape == (batch, 40) and got[1].shape == (batch,)
        check(got, want)


# --- CUDA only: no host sync, CUDA-graph capture, CPU agreement, large N -------------------------


@pytest.mark.cuda
def test_cuda_mixed_devices():
    boxes, scores = batch_of("random", 1, 5, seed=0)
    with pytest.raises(RuntimeError, match="detops.nms_padded: boxes and scores must be on the same device"):
        nms_padded(boxes.cuda(), scores, 0.5)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["random", "clustered"])
def test_cuda_agrees_with_cpu(dtype, kind):
    for batch, n in [(1, 1), (3, 63), (2, 64), (2, 65), (8, 4700), (2, 12000)]:
        boxes, scores = batch_of(kind, batch, n, seed=n, dtype=dtype)
        for iou, score_thr, max_output in [(0.5, float("-inf"), 100), (0.7, 0.3, 1000), (0.3, 0.0, n + 3)]:
            got = nms_padded(boxes.cuda(), scores.cuda(), iou, score_thr, max_output)
            check(got, nms_padded(boxes, scores, iou, score_thr, max_output))


@pytest.mark.cuda
@pytest.mark.parametrize("n", [31, 33, 1000, 8192, 8193])
def test_cuda_around_the_counting_rank_limit(n):
    # Up to 8192 boxes per image, with scores of the boxes' dtype, each image is ranked by
    # counting the boxes ahead of each; above that, or with scores of another dtype, by torch's
    # sort. Ties, signed zeros, NaN and infinities rank alike on both paths and on the CPU.
    boxes, scores = batch_of("random", 2, n, seed=n)
    scores = (scores * 8).round() / 8  # many ties: equal scores keep index order
    scores[0, ::97] = -0.0
    scores[0, 1::97] = 0.0
    scores[1, 2::101] = math.nan
    scores[1, 3::103] = -math.inf
    scores[1, 4::103] = math.inf
    for b, s in [(boxes, scores), (boxes, scores.half()), (boxes.half(), scores.half())]:
        for score_thr in (-math.inf, 0.25):
            got = nms_padded(b.cuda(), s.cuda(), 0.5, score_thr, n)
            check(got, nms_padded(b, s, 0.5, score_thr, n))
            if n <= 1000:  # the reference takes seconds at 8192
                check(got, ref.nms_padded(b, s, 0.5, score_thr, n))


@pytest.mark.cuda
def test_cuda_large_n():
    # 20k boxes per image: a 2 x 20000 x 313 x 8 byte (100 MB) mask
    boxes, scores = batch_of("random", 2, 20000, seed=9)
    got = nms_padded(boxes.cuda(), scores.cuda(), 0.5, 0.05, 5000)
    check(got, nms_padded(boxes, scores, 0.5, 0.05, 5000))
    check(got, torchvision_padded(boxes, scores, 0.5, 0.05, 5000))


@pytest.mark.cuda
def test_cuda_most_boxes():
    # 393216 boxes per image, the most the suppression words in shared memory allow (48 KiB of
    # them, beside the kernel's own shared memory: past the default limit). Disjoint boxes: every
    # box is kept, so the output is the ranking's first max_output positions. (A 19 GB mask.)
    if torch.cuda.get_device_properties(0).total_memory < 24 * 2**30:
        pytest.skip("needs a GPU with 24 GB or more for the 19 GB suppression mask")
    n = 6144 * 64
    g = torch.Generator().manual_seed(0)
    corner = torch.arange(n, dtype=torch.float32)
    x1, y1 = (corner % 1024) * 4, torch.div(corner, 1024, rounding_mode="floor") * 4
    boxes = torch.stack([x1, y1, x1 + 2, y1 + 2], -1)[None]
    scores = torch.rand(1, n, generator=g)
    idx, cnt = nms_padded(boxes.cuda(), scores.cuda(), 0.5, max_output=100)
    assert cnt.tolist() == [100]
    assert torch.equal(idx.cpu(), scores.sort(dim=1, descending=True, stable=True).indices[:, :100])


@pytest.mark.cuda
def test_cuda_too_many_boxes():
    with pytest.raises(RuntimeError, match="detops.nms_padded: at most 393216 boxes per image on CUDA"):
        nms_padded(torch.rand(1, 393217, 4, device="cuda"), torch.rand(1, 393217, device="cuda"), 0.5)


@pytest.mark.cuda
def test_cuda_no_host_sync():
    boxes, scores = batch_of("clustered", 4, 3000, seed=5)
    boxes, scores = boxes.cuda(), scores.cuda()
    for dtype in DTYPES:
        nms_padded(boxes.to(dtype), scores.to(dtype), 0.5, 0.1, 100)  # warm-up (allocations, lazy init)
    torch.cuda.synchronize()
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for dtype in DTYPES:
            nms_padded(boxes.to(dtype), scores.to(dtype), 0.5, 0.1, 100)
            nms_padded(boxes.to(dtype), scores.to(dtype), 0.7, max_output=5000)
        nms_padded(boxes[:, :0], scores[:, :0], 0.5)
        nms_padded(boxes, scores, 0.5, max_output=0)
    finally:
        torch.cuda.set_sync_debug_mode(old)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cuda_graph_capture_and_replay(dtype):
    boxes, scores = batch_of("clustered", 4, 2500, seed=1, dtype=dtype)
    static_boxes, static_scores = boxes.cuda(), scores.cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up on the side stream, as the CUDA graphs docs ask
            nms_padded(static_boxes, static_scores, 0.5, 0.2, 300)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_idx, static_cnt = nms_padded(static_boxes, static_scores, 0.5, 0.2, 300)
    for seed in (7, 8, 9):
        new_boxes, new_scores = batch_of("random" if seed % 2 else "clustered", 4, 2500, seed=seed, dtype=dtype)
        new_scores[seed % 4] = 0.0  # one image with nothing above the score threshold
        static_boxes.copy_(new_boxes)
        static_scores.copy_(new_scores)
        graph.replay()
        torch.cuda.synchronize()
        eager = nms_padded(new_boxes.cuda(), new_scores.cuda(), 0.5, 0.2, 300)
        check((static_idx, static_cnt), eager)
        check(eager, nms_padded(new_boxes, new_scores, 0.5, 0.2, 300))
