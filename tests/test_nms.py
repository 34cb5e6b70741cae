"""detops.ops.nms / batched_nms against torchvision and the plain-PyTorch reference."""
import math

import pytest
import torch
import torchvision

import detops
from detops.ops import batched_nms, nms
from detops.reference import nms as ref
from detops.testing import clustered_boxes, random_boxes
from tests.conftest import DEVICES

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
THRESHOLDS = [0.2, 0.5, 0.8]


def assert_same_keep(got, expected, scores):
    """Equal kept sets, listed by decreasing score; boxes of equal score may swap places."""
    got, expected = got.cpu(), expected.cpu()
    assert got.dtype == torch.int64
    assert got.shape == expected.shape, f"kept {got.numel()} boxes, expected {expected.numel()}"
    assert set(got.tolist()) == set(expected.tolist())
    s = scores.cpu().float()
    assert torch.equal(s[got], s[expected])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["random", "clustered"])
@pytest.mark.parametrize("threshold", THRESHOLDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_nms_matches_torchvision(device, kind, threshold, dtype):
    gen = random_boxes if kind == "random" else clustered_boxes
    boxes, scores = gen(3000, seed=int(threshold * 10), dtype=dtype)
    boxes, scores = boxes.to(device), scores.to(device)
    got = nms(boxes, scores, threshold)
    assert got.device == boxes.device
    assert_same_keep(got, torchvision.ops.nms(boxes.cpu(), scores.cpu(), threshold), scores)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["random", "clustered"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_nms_matches_reference(device, kind, dtype):
    gen = random_boxes if kind == "random" else clustered_boxes
    for threshold in THRESHOLDS:
        boxes, scores = gen(1500, seed=7, dtype=dtype)
        got = nms(boxes.to(device), scores.to(device), threshold)
        assert torch.equal(got.cpu(), ref.nms(boxes, scores, threshold))


def greedy_over_the_whole_matrix(boxes, scores, threshold):
    """Greedy NMS over the whole [N, N] IoU matrix: what ref.nms computes a block of rows at a
    time."""
    above = ref.pairwise_iou(boxes).double() > threshold
    removed = torch.zeros(boxes.size(0), dtype=torch.bool)
    keep = []
    for i in torch.sort(scores, descending=True, stable=True).indices.tolist():
        if not (torch.isnan(scores[i]) or removed[i]):
            keep.append(i)
            removed |= above[i]
    return torch.tensor(keep, dtype=torch.int64)


@pytest.mark.parametrize("n", [1, 255, 256, 257, 700])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_reference_nms_in_blocks_is_greedy_over_the_whole_matrix(n, dtype):
    # ref.nms decides the score order a block of rows at a time, against the boxes still in
    # play: the same keep as the whole matrix, across block edges, chains, ties and NaNs
    cases = [chain_boxes(n, dtype), clustered_boxes(n, seed=n, dtype=dtype), random_boxes(n, seed=n, dtype=dtype)]
    boxes, scores = random_boxes(n, seed=n + 1, dtype=dtype)
    scores = torch.randint(0, 5, (n,), generator=torch.Generator().manual_seed(n)).to(dtype)  # many equal scores
    if n > 3:
        boxes[1, 2] = float("nan")
        scores[2] = float("nan")
    cases.append((boxes, scores))
    for boxes, scores in cases:
        for threshold in (0.0, 0.3, 0.5, 1.0):
            assert torch.equal(ref.nms(boxes, scores, threshold), greedy_over_the_whole_matrix(boxes, scores, threshold))


@pytest.mark.parametrize("device", DEVICES)
def test_nms_ties_keep_index_order(device):
    boxes, _ = random_boxes(500, seed=3)
    scores = torch.randint(0, 4, (500,)).float()  # many equal scores
    got = nms(boxes.to(device), scores.to(device), 0.5).cpu()
    assert torch.equal(got, ref.nms(boxes, scores, 0.5))
    s = scores[got]
    assert bool((s[:-1] >= s[1:]).all())
    for value in s.unique():
        same = got[s == value]
        assert torch.equal(same, same.sort().values)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("threshold", [0.3, 0.5, 0.7])
def test_nms_iou_just_above_and_below(device, threshold):
    # IoU([0,0,10,10], [0,0,10,h]) = h / 10
    eps = 1e-3
    for h, suppressed in [(10 * threshold + eps, True), (10 * threshold - eps, False)]:
        boxes = torch.tensor([[0.0, 0.0, 10.0, 10.0], [0.0, 0.0, 10.0, h]], device=device)
        scores = torch.tensor([0.9, 0.8], device=device)
        got = nms(boxes, scores, threshold).tolist()
        assert got == ([0] if suppressed else [0, 1]), (h, got)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_nms_iou_equal_to_threshold_is_kept(device, dtype):
    # IoU = 50 / 100 = 0.5 exactly: suppression needs IoU > threshold
    boxes = torch.tensor([[0.0, 0.0, 10.0, 10.0], [0.0, 0.0, 10.0, 5.0]], dtype=dtype, device=device)
    scores = torch.tensor([0.9, 0.8], dtype=dtype, device=device)
    assert nms(boxes, scores, 0.5).tolist() == [0, 1]
    assert nms(boxes, scores, 0.4999).tolist() == [0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("threshold", [0.1, 0.2, 0.3, 0.7, 0.9])
def test_nms_threshold_compared_in_full_precision(device, threshold):
    # IoU = k / 100 in float32 for boxes [0,0,10,10] vs [0,0,10,k/10]; decided like torchvision's
    # CPU kernel (float IoU against the double threshold), on every device.
    for k in range(1, 100):
        boxes = torch.tensor([[0.0, 0.0, 10.0, 10.0], [0.0, 0.0, 10.0, k / 10]], device=device)
        scores = torch.tensor([0.9, 0.8], device=device)
        expected = torchvision.ops.nms(boxes.cpu(), scores.cpu(), threshold)
        assert torch.equal(nms(boxes, scores, threshold).cpu(), expected), k


NEAR_TIE_THRESHOLDS = [0.5, 0.6, 0.7, 1 / 3]


def _separate_pairs(seed, scale):
    """Pairs of boxes (a_i, b_i), pair i moved along y so that no two pairs overlap:
      * [0, 0, q, 1] and [0, 0, p, 1] for 1 <= p <= q <= 64 (IoU p / q: every simple fraction);
      * random boxes with small integer corners;
      * [0, 0, W, H] and [0, 0, w, H] with w one float away from t * W for each t of
        NEAR_TIE_THRESHOLDS: IoUs within a few roundings of t, where inter > t * union in
        floating point often disagrees with the quotient's comparison.
    All corners are multiplied by `scale`. Returns the boxes [a_0..a_k, b_0..b_k] and the
    float32 IoUs computed term by term as torchvision computes them."""
    g = torch.Generator().manual_seed(seed)
    q, p = torch.tril_indices(64, 64).float() + 1
    zeros, ones = torch.zeros_like(p), torch.ones_like(p)
    pairs = [torch.stack([torch.stack([zeros, zeros, q, ones], 1), torch.stack([zeros, zeros, p, ones], 1)])]
    lo = torch.randint(0, 24, (2, 2000, 2), generator=g).float()
    size = torch.randint(1, 9, (2, 2000, 2), generator=g).float()
    pairs.append(torch.cat([lo, lo + size], 2))
    for t in NEAR_TIE_THRESHOLDS:
        wide, tall = torch.rand(2, 500, generator=g) * 999 + 1
        narrow = wide * t
        narrow = torch.where(torch.rand(500, generator=g) < 0.5, narrow, torch.nextafter(narrow, narrow * 2))
        narrow = torch.where(torch.rand(500, generator=g) < 0.5, narrow, torch.nextafter(narrow, narrow / 2))
        z = torch.zeros(500)
        pairs.append(torch.stack([torch.stack([z, z, wide, tall], 1), torch.stack([z, z, narrow, tall], 1)]))
    corners = torch.cat(pairs, 1)  # [2, count, 4]
    corners[..., 1::2] += 1024 * torch.arange(corners.shape[1]).float()[:, None]
    corners = corners * scale
    a, b = corners[0], corners[1]
    w = (torch.minimum(a[:, 2], b[:, 2]) - torch.maximum(a[:, 0], b[:, 0])).clamp(min=0)
    h = (torch.minimum(a[:, 3], b[:, 3]) - torch.maximum(a[:, 1], b[:, 1])).clamp(min=0)
    inter = w * h
    area = lambda x: (x[:, 2] - x[:, 0]) * (x[:, 3] - x[:, 1])
    return torch.cat([a, b]), inter / ((area(a) + area(b)) - inter)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", [1.0, 0.001, 1e-12, 1e10, 2.0**-29, 2.0**29])
def test_nms_decides_ties_and_near_ties_exactly(device, scale):
    # The CUDA kernels decide most pairs without the division (csrc/cuda/nms_tile.cuh);
    # pairs at or a few rounding steps from the threshold must still be decided as the
    # division decides them.
    # Areas below 2^-60 (scale 1e-12) or above 2^60 (1e10) are decided by the division alone.
    # At scales 2^-29 and 2^29 the smallest or the largest boxes fall just outside the plain
    # areas [2^-58, 2^58] (iou_plain_box), so tiles mix plain boxes with others.
    boxes, iou = _separate_pairs(seed=5, scale=scale)
    count = iou.numel()
    scores = torch.cat([torch.ones(count), torch.full((count,), 0.5)])
    idxs = torch.arange(count).repeat(2)
    f7 = float(torch.tensor(0.7))  # 0.7 rounded to float32, and the floats on either side
    thresholds = NEAR_TIE_THRESHOLDS + [0.25, 2 / 3, 0.9, f7, math.nextafter(f7, 1.0), math.nextafter(f7, 0.0), 0.0]
    for t in thresholds:
        expected = set(range(count)) | set(((~(iou.double() > t)).nonzero().flatten() + count).tolist())
        for got in (
            nms(boxes.to(device), scores.to(device), t),
            batched_nms(boxes.to(device), scores.to(device), idxs.to(device), t),
        ):
            assert set(got.tolist()) == expected, t


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_nms_empty_and_single(device, dtype):
    empty = nms(torch.empty(0, 4, dtype=dtype, device=device), torch.empty(0, dtype=dtype, device=device), 0.5)
    assert empty.shape == (0,) and empty.dtype == torch.int64 and empty.device.type == device
    one = nms(torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=dtype, device=device), torch.tensor([0.3], dtype=dtype, device=device), 0.5)
    assert one.tolist() == [0]
    e = batched_nms(
        torch.empty(0, 4, device=device), torch.empty(0, device=device), torch.empty(0, dtype=torch.int64, device=device), 0.5
    )
    assert e.shape == (0,) and e.dtype == torch.int64


@pytest.mark.parametrize("device", DEVICES)
def test_nms_non_contiguous(device):
    boxes, scores = random_boxes(800, seed=11)
    boxes_t = boxes.t().contiguous().t()  # column-major view
    scores_s = torch.stack([scores, scores], 1)[:, 0]  # strided
    assert not boxes_t.is_contiguous() and not scores_s.is_contiguous()
    got = nms(boxes_t.to(device), scores_s.to(device), 0.5)
    assert torch.equal(got.cpu(), nms(boxes, scores, 0.5))


@pytest.mark.parametrize("device", DEVICES)
def test_nms_nan_and_inf(device):
    nan, inf = math.nan, math.inf
    boxes = torch.tensor(
        [
            [0.0, 0.0, 10.0, 10.0],  # 0: kept
            [0.0, 0.0, 10.0, 10.0],  # 1: NaN score -> dropped, suppresses nothing
            [0.0, 0.0, nan, 10.0],  # 2: NaN coordinate -> kept, never suppressed
            [1.0, 1.0, 10.0, 10.0],  # 3: suppressed by 0
            [0.0, 0.0, inf, inf],  # 4: infinite area: IoU 0 with finite boxes -> kept
            [0.0, 0.0, 10.0, 10.0],  # 5: -inf score, ranks last, suppressed by 0
        ],
        device=device,
    )
    scores = torch.tensor([0.9, nan, 0.95, 0.8, 0.5, -inf], device=device)
    got = nms(boxes, scores, 0.5).tolist()
    assert got == [2, 0, 4]
    assert got == ref.nms(boxes.cpu(), scores.cpu(), 0.5).tolist()
    # a NaN score never suppresses, even with the highest rank
    assert nms(boxes[:2], torch.tensor([nan, 0.1], device=device), 0.5).tolist() == [1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("threshold", [0.3, 0.7])
def test_batched_nms_matches_torchvision(device, threshold):
    boxes, scores = clustered_boxes(4000, seed=5)
    idxs = torch.randint(0, 80, (4000,), generator=torch.Generator().manual_seed(1))
    got = batched_nms(boxes.to(device), scores.to(device), idxs.to(device), threshold)
    assert_same_keep(got, torchvision.ops.batched_nms(boxes, scores, idxs, threshold), scores)
    assert torch.equal(got.cpu(), ref.batched_nms(boxes, scores, idxs, threshold))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_batched_nms_negative_coordinates_and_low_precision(device, dtype):
    # Boxes near -1000 and +1000 in 80 categories: an offset trick (category * (max + 1))
    # would overflow float16 (> 65504) or round the boxes in bfloat16.
    boxes, scores = clustered_boxes(2000, seed=9)
    boxes = boxes * 2 - 1000
    idxs = torch.randint(-3, 77, (2000,), generator=torch.Generator().manual_seed(2))
    boxes, scores = boxes.to(dtype), scores.to(dtype)
    got = batched_nms(boxes.to(device), scores.to(device), idxs.to(device), 0.5)
    assert torch.equal(got.cpu(), ref.batched_nms(boxes, scores, idxs, 0.5))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32, torch.uint8])
def test_batched_nms_equals_per_class_nms(device, idx_dtype):
    boxes, scores = clustered_boxes(1000, seed=4)
    idxs = torch.randint(0, 5, (1000,), generator=torch.Generator().manual_seed(3)).to(idx_dtype)
    got = batched_nms(boxes.to(device), scores.to(device), idxs.to(device), 0.5).cpu()
    parts = []
    for c in range(5):
        sel = torch.nonzero(idxs == c).flatten()
        parts.append(sel[nms(boxes[sel], scores[sel], 0.5)])
    expected = torch.cat(parts)
    assert set(got.tolist()) == set(expected.tolist())
    # one category: batched NMS is plain NMS
    same = torch.zeros(1000, dtype=idx_dtype)
    assert torch.equal(batched_nms(boxes, scores, same, 0.5), nms(boxes, scores, 0.5))


def test_maskrcnn_style_entry_reaches_the_same_op():
    boxes, scores = random_boxes(500, seed=1)
    assert torch.equal(detops._C.nms(boxes, scores, 0.5), nms(boxes, scores, 0.5))
    idxs = torch.randint(0, 3, (500,))
    assert torch.equal(detops._C.batched_nms(boxes, scores, idxs, 0.5), batched_nms(boxes, scores, idxs, 0.5))


BAD_INPUTS = [
    ("[N, 5] boxes", lambda: (torch.rand(7, 5), torch.rand(7)), "boxes must be a [N, 4] tensor, got [7, 5]"),
    ("1-D boxes", lambda: (torch.rand(4), torch.rand(1)), "boxes must be a [N, 4] tensor, got [4]"),
    ("2-D scores", lambda: (torch.rand(7, 4), torch.rand(7, 1)), "scores must be a [N] tensor"),
    ("different N", lambda: (torch.rand(7, 4), torch.rand(6)), "boxes and scores must have the same number of entries"),
    ("int boxes", lambda: (torch.randint(0, 9, (7, 4)), torch.rand(7)), "boxes must be a float32"),
    ("bool scores", lambda: (torch.rand(7, 4), torch.rand(7) > 0.5), "scores must be a float32"),
]


@pytest.mark.parametrize("name,make,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_nms_bad_input(name, make, message):
    boxes, scores = make()
    with pytest.raises(RuntimeError, match="detops.nms: " + message.replace("[", r"\[").replace("]", r"\]")):
        nms(boxes, scores, 0.5)
    with pytest.raises(RuntimeError, match="detops.batched_nms: "):
        batched_nms(boxes, scores, torch.zeros(boxes.shape[0], dtype=torch.int64), 0.5)


@pytest.mark.parametrize("threshold", [math.nan, math.inf, -math.inf])
def test_nms_non_finite_threshold(threshold):
    with pytest.raises(RuntimeError, match="detops.nms: iou_threshold must be a finite number"):
        nms(torch.rand(3, 4), torch.rand(3), threshold)


def test_batched_nms_bad_idxs():
    boxes, scores = random_boxes(5, seed=0)
    with pytest.raises(RuntimeError, match="detops.batched_nms: idxs must be an integer tensor, got Float"):
        batched_nms(boxes, scores, torch.zeros(5), 0.5)
    with pytest.raises(RuntimeError, match=r"detops.batched_nms: boxes and idxs must have the same number"):
        batched_nms(boxes, scores, torch.zeros(4, dtype=torch.int64), 0.5)
    with pytest.raises(RuntimeError, match=r"detops.batched_nms: idxs must be a \[N\] tensor"):
        batched_nms(boxes, scores, torch.zeros(5, 1, dtype=torch.int64), 0.5)


@pytest.mark.cuda
def test_nms_mixed_devices():
    boxes, scores = random_boxes(5, seed=0)
    with pytest.raises(RuntimeError, match="detops.nms: boxes and scores must be on the same device"):
        nms(boxes.cuda(), scores, 0.5)
    with pytest.raises(RuntimeError, match="detops.nms: boxes and scores must be on the same device"):
        nms(boxes, scores.cuda(), 0.5)
    with pytest.raises(RuntimeError, match="detops.batched_nms: boxes and idxs must be on the same device"):
        batched_nms(boxes.cuda(), scores.cuda(), torch.zeros(5, dtype=torch.int64), 0.5)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["random", "clustered"])
def test_nms_cpu_cuda_agree(dtype, kind):
    gen = random_boxes if kind == "random" else clustered_boxes
    for n in [1, 63, 64, 65, 4000, 12000]:
        boxes, scores = gen(n, seed=n, dtype=dtype)
        for t in THRESHOLDS:
            assert torch.equal(nms(boxes.cuda(), scores.cuda(), t).cpu(), nms(boxes, scores, t))
        idxs = torch.randint(0, 80, (n,), generator=torch.Generator().manual_seed(n))
        assert torch.equal(
            batched_nms(boxes.cuda(), scores.cuda(), idxs.cuda(), 0.5).cpu(), batched_nms(boxes, scores, idxs, 0.5)
        )


@pytest.mark.cuda
def test_nms_cuda_large_uses_global_scratch():
    # more than 48 KiB of suppression words (393,216 boxes) takes the global-memory path
    boxes, scores = random_boxes(400_000, seed=2, size=20000.0, max_wh=60.0)
    got = nms(boxes.cuda(), scores.cuda(), 0.5).cpu()
    assert torch.equal(got, nms(boxes, scores, 0.5))


def test_opcheck():
    boxes, scores = clustered_boxes(200, seed=0)
    idxs = torch.randint(0, 4, (200,))
    torch.library.opcheck(torch.ops.detops.nms, (boxes, scores, 0.5))
    torch.library.opcheck(torch.ops.detops.batched_nms, (boxes, scores, idxs, 0.5))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device):
    torch._dynamo.reset()

    def postprocess(boxes, scores, labels):
        keep = batched_nms(boxes, scores, labels, 0.5)
        keep2 = nms(boxes, scores, 0.7)
        return boxes[keep], scores[keep], keep2.numel()

    boxes, scores = clustered_boxes(300, seed=1)
    labels = torch.randint(0, 3, (300,))
    args = [t.to(device) for t in (boxes, scores, labels)]
    compiled = torch.compile(postprocess, fullgraph=True, backend="eager" if device == "cpu" else "inductor")
    got, want = compiled(*args), postprocess(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[2] == want[2]


def test_export_dynamic_box_count():
    class Post(torch.nn.Module):
        def forward(self, boxes, scores, labels):
            return batched_nms(boxes, scores, labels, 0.5), nms(boxes, scores, 0.5)

    boxes, scores = clustered_boxes(300, seed=2)
    labels = torch.randint(0, 3, (300,))
    n = torch.export.Dim("n", min=2)
    ep = torch.export.export(Post(), (boxes, scores, labels), dynamic_shapes=({0: n}, {0: n}, {0: n}))
    for size in (50, 300, 900):
        b, s = clustered_boxes(size, seed=size)
        lab = torch.randint(0, 3, (size,))
        for got, want in zip(ep.module()(b, s, lab), Post()(b, s, lab)):
            assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_nms_large_with_special_boxes(device, dtype):
    # Enough boxes for the CPU grid path, with boxes it must keep out of the grid (NaN,
    # infinite, inverted, zero-width, and a few huge ones) mixed in.
    boxes, scores = clustered_boxes(2000, seed=21, dtype=dtype)
    g = torch.Generator().manual_seed(5)
    pick = torch.randperm(2000, generator=g)[:60]
    nan, inf = math.nan, math.inf
    specials = torch.tensor(
        [[nan, 0, 10, 10], [0, 0, inf, 500], [-inf, -inf, inf, inf], [500, 500, 400, 600],
         [300, 300, 300, 400], [0, 0, 1000, 1000], [100, 100, 900, 900], [250, 0, 260, 1000]],
        dtype=dtype,
    )
    boxes[pick] = specials[torch.arange(60) % len(specials)]
    scores[pick[::7]] = nan
    for threshold in (0.3, 0.7):
        got = nms(boxes.to(device), scores.to(device), threshold).cpu()
        assert torch.equal(got, ref.nms(boxes, scores, threshold))
    idxs = torch.randint(0, 5, (2000,), generator=g)
    got = batched_nms(boxes.to(device), scores.to(device), idxs.to(device), 0.5).cpu()
    assert torch.equal(got, ref.batched_nms(boxes, scores, idxs, 0.5))


def chain_boxes(n, dtype=torch.float32):
    """Boxes along a line, each overlapping only its neighbours (IoU 0.6, then 0.33), with
    decreasing scores: greedy NMS keeps every other box, and each decision depends on the
    previous one (a dependency chain as long as the input)."""
    x = torch.arange(n, dtype=torch.float64) * 2.5
    boxes = torch.stack([x, torch.zeros(n, dtype=torch.float64), x + 10, torch.full((n,), 10.0, dtype=torch.float64)], 1)
    scores = torch.linspace(1.0, 0.1, n, dtype=torch.float64)
    return boxes.to(dtype), scores.to(dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("n", [1, 70, 1000, 4096, 4097, 9000, 40000])
def test_nms_cuda_long_chains(n):
    # The CUDA pass decides boxes as their inputs arrive (across the warps of one block up to
    # 4096 boxes, across blocks above): the result must be the greedy one, also on a chain of
    # decisions as long as the input.
    boxes, scores = chain_boxes(n)
    got = nms(boxes.cuda(), scores.cuda(), 0.5).cpu()
    assert torch.equal(got, torch.arange(0, n, 2))
    for gen in (random_boxes, clustered_boxes):
        b, s = gen(n, seed=n)
        assert torch.equal(nms(b.cuda(), s.cuda(), 0.5).cpu(), ref.nms(b, s, 0.5))
        idxs = torch.randint(0, 7, (n,), generator=torch.Generator().manual_seed(1))
        assert torch.equal(
            batched_nms(b.cuda(), s.cuda(), idxs.cuda(), 0.5).cpu(), batched_nms(b, s, idxs, 0.5)
        )
    cb, cs = chain_boxes(n)
    cls = torch.arange(n) % 2  # two interleaved chains that never suppress each other
    assert torch.equal(batched_nms(cb.cuda(), cs.cuda(), cls.cuda(), 0.5).cpu(), batched_nms(cb, cs, cls, 0.5))


@pytest.mark.cuda
@pytest.mark.parametrize("n", [1, 2, 31, 33, 257, 1000, 4096, 4097, 8191, 8192, 8193, 16384])
@pytest.mark.parametrize("dtype", DTYPES)
def test_nms_cuda_around_the_counting_rank_limit(n, dtype):
    # Up to 8192 boxes each box's rank is counted (the boxes ahead of it:
    # higher scores, equal scores at lower indices); above that torch's sort ranks them.
    boxes, scores = random_boxes(n, seed=n, dtype=dtype)
    scores = (scores * 8).round() / 8  # many ties: equal scores keep index order
    scores[::97] = -0.0
    scores[1::97] = 0.0
    scores[2::101] = math.nan
    scores[3::103] = -math.inf
    scores[4::103] = math.inf
    got = nms(boxes.cuda(), scores.cuda(), 0.5).cpu()
    assert torch.equal(got, nms(boxes, scores, 0.5))
    assert torch.equal(got, ref.nms(boxes, scores, 0.5))
    # Batched NMS counts up to 8192 boxes where a block has 100 KiB of shared memory (5120 with
    # 64 KiB), comparing 64-bit categories as well.
    g = torch.Generator().manual_seed(n)
    idxs = torch.randint(-1, 2, (n,), generator=g) * 2**62 + torch.randint(0, 3, (n,), generator=g)
    idxs[5::89] = torch.iinfo(torch.int64).max
    idxs[6::89] = torch.iinfo(torch.int64).min
    got = batched_nms(boxes.cuda(), scores.cuda(), idxs.cuda(), 0.5).cpu()
    assert torch.equal(got, batched_nms(boxes, scores, idxs, 0.5))
    assert torch.equal(got, ref.batched_nms(boxes, scores, idxs, 0.5))


@pytest.mark.cuda
def test_nms_cuda_scores_of_another_dtype():
    boxes, scores = random_boxes(3000, seed=4)
    for sdtype in (torch.float16, torch.float64):
        s = scores.to(sdtype)
        assert torch.equal(nms(boxes.cuda(), s.cuda(), 0.5).cpu(), nms(boxes, s, 0.5))


@pytest.mark.cuda
@pytest.mark.parametrize("n", [9001, 3000])
def test_nms_cuda_radix_ranking_strided_and_mixed_dtypes(n):
    # Above the counting rank (9001 boxes: an odd count, so the alignment of the batched
    # ranking's 64-bit category keys among its 32-bit buffers cannot rest on an even count) and
    # for scores of another dtype than the boxes (3000 boxes), CUDA NMS ranks by a radix sort of
    # score keys: strided boxes, scores and 32-bit categories, 16-bit scores, ties, -0.0 and NaN.
    boxes, scores = clustered_boxes(n, seed=n)
    scores = (scores * 16).round() / 16
    scores[::53] = -0.0
    scores[1::53] = 0.0
    scores[2::59] = math.nan
    g = torch.Generator().manual_seed(n)
    idxs = torch.randint(-4, 5, (n,), generator=g, dtype=torch.int32)
    boxes_cuda = boxes.cuda().t().contiguous().t()
    idxs_cuda = torch.stack([idxs, idxs], 1).cuda()[:, 1]
    assert not boxes_cuda.is_contiguous() and not idxs_cuda.is_contiguous()
    for sdtype in (torch.float32, torch.bfloat16, torch.float16):
        s = scores.to(sdtype)
        s_cuda = torch.stack([s, s], 1).cuda()[:, 0]
        assert not s_cuda.is_contiguous()
        got = nms(boxes_cuda, s_cuda, 0.5).cpu()
        assert torch.equal(got, nms(boxes, s, 0.5)), sdtype
        assert torch.equal(got, ref.nms(boxes, s.float(), 0.5)), sdtype
        got = batched_nms(boxes_cuda, s_cuda, idxs_cuda, 0.5).cpu()
        assert torch.equal(got, batched_nms(boxes, s, idxs, 0.5)), sdtype
        assert torch.equal(got, ref.batched_nms(boxes, s.float(), idxs.long(), 0.5)), sdtype


def _adversarial_sets(n: int, g: torch.Generator):
    """Inputs of n boxes that stress the CPU grid pass (segments of 1024+ boxes)."""
    b, s = random_boxes(n, seed=31)
    yield "random", b, s
    yield "clustered", *clustered_boxes(n, seed=32)
    dup = b.clone()
    dup[n // 2 :] = dup[: n - n // 2]
    yield "duplicates", dup, torch.rand(n, generator=g)
    yield "identical", torch.tensor([[1.0, 2.0, 30.0, 40.0]]).repeat(n, 1), torch.rand(n, generator=g)
    yield "tied scores", b, torch.randint(0, 3, (n,), generator=g).float()
    c = torch.rand(n, 2, generator=g) * 50 + 500
    r = torch.rand(n, 1, generator=g) * 400 + 0.01
    yield "nested", torch.cat([c - r, c + r], 1), torch.rand(n, generator=g)
    scale = 10 ** torch.randint(-30, 30, (n, 1), generator=g).float()
    xy, wh = torch.rand(n, 2, generator=g) * scale, torch.rand(n, 2, generator=g) * scale
    yield "huge and tiny", torch.cat([xy, xy + wh], 1), torch.rand(n, generator=g)
    xy, wh = torch.rand(n, 2, generator=g) * 1e-30, torch.rand(n, 2, generator=g) * 1e-30
    yield "tiny", torch.cat([xy, xy + wh], 1), torch.rand(n, generator=g)
    far = b.clone()
    far[::3] += 1e6
    far[1::3] -= 3e7
    yield "far apart", far, s
    wide = b.clone()
    wide[torch.randperm(n, generator=g)[: n // 20], 2:] += 900  # a few boxes far wider than the rest
    yield "outliers", wide, s
    xy = torch.randint(0, 40, (n, 2), generator=g).float()
    wh = torch.randint(1, 10, (n, 2), generator=g).float()
    yield "integer grid", torch.cat([xy, xy + wh], 1), torch.rand(n, generator=g)
    nan, inf = math.nan, math.inf
    sp = b.clone()
    pick = torch.randperm(n, generator=g)[: n // 10]
    specials = torch.tensor(
        [[nan, 0, 10, 10], [0, 0, inf, 500], [-inf, -inf, inf, inf], [500, 500, 400, 600], [300, 300, 300, 400],
         [0, 0, 1000, 1000], [100, 100, 900, 900], [250, 0, 260, 1000], [-3e38, 0, 3e38, 10], [0, 0, 3e38, 3e38]]
    )
    sp[pick] = specials[torch.arange(len(pick)) % len(specials)]
    ss = s.clone()
    ss[pick[::7]], ss[pick[1::7]], ss[pick[2::7]] = nan, inf, -inf
    yield "nan and inf", sp, ss
    yield "negative", b * 3 - 2000, s


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [1024, 1300])
def test_nms_cpu_grid_pass_adversarial(n, threads):
    # Segments of 1024+ boxes take the CPU grid pass (with blocks of 1024 tested in parallel
    # when more than one thread is free); it must decide exactly like the dense reference.
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(n + threads)
        for name, boxes, scores in _adversarial_sets(n, g):
            for dtype in DTYPES:
                b, s = boxes.to(dtype), scores.to(dtype)
                for threshold in (0.0, 1e-7, 0.5, 0.7, 1.0):
                    assert torch.equal(nms(b, s, threshold), ref.nms(b, s, threshold)), (name, dtype, threshold)
                idxs = torch.randint(0, 2, (n,), generator=g)
                assert torch.equal(batched_nms(b, s, idxs, 0.5), ref.batched_nms(b, s, idxs, 0.5)), (name, dtype)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_nms_cpu_grid_pass_matches_torchvision_large(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for gen, n in ((random_boxes, 12000), (clustered_boxes, 6000)):
            boxes, scores = gen(n, seed=n)
            for threshold in (0.3, 0.5, 0.9):
                got = nms(boxes, scores, threshold)
                assert torch.equal(got, torchvision.ops.nms(boxes, scores, threshold))
    finally:
        torch.set_num_threads(before)
