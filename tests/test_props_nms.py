"""Property-based tests (hypothesis) of nms, batched_nms and nms_padded on every device.

Inputs are drawn as a tile of a few boxes (integer corners that touch, nest and repeat,
fractional ones, degenerate, inverted, far away, huge, NaN and infinite ones) with scores (ties,
+-0, +-inf, NaN), repeated on a lattice up to a few thousand boxes (past the CUDA kernels'
limits, sparingly), scaled and moved (huge coordinates), in any float dtype, with scores of the
boxes' dtype or another, and contiguous or strided. Thresholds are drawn at 0 and 1, beyond
them, anywhere between, and at (or one rounding step beside) the IoU of a drawn pair, computed
as the kernels compute it (float32, float64 for float64 boxes).

Properties: the kept indices equal the reference's (detops/reference) and torchvision's where
torchvision defines the case; kept boxes are listed by decreasing score, equal scores by index;
NMS of the kept boxes keeps them all; batched_nms equals per-category nms; nms_padded's rows
equal per-image nms of the passing boxes, cut to max_output; on the CPU every greedy pass (dense,
window, grid, serial or by blocks on several threads) and on CUDA every ranking and pass forced
through nms_kernel gives the same indices.
"""
import math

import pytest
import torch
import torchvision
from hypothesis import event, example, given, note, settings
from hypothesis import strategies as st

from detops.ops import batched_nms, nms, nms_padded
from detops.ops._utils import nms_kernel
from detops.reference import nms as ref
from detops.reference import nms_padded as ref_padded
from tests.conftest import DEVICES, with_threads

nan, inf = math.nan, math.inf
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
RANKS = ["auto", "count", "radix", "sort"]
PASSES = ["auto", "block", "dataflow"]
# CUDA limits of the kernel variants (csrc/cuda/nms_rank.cuh, nms.cu): counting ranks up to
# 8192 boxes, the one-block pass takes up to 4096. CPU: the window pass from 48 boxes a
# segment, the grid pass from 1024 (csrc/cpu/nms.cpp).
MAX_COUNT_RANK, MAX_BLOCK_PASS = 8192, 4096
WINDOW_MIN, GRID_MIN = 48, 1024

# Boxes that the arithmetic treats specially: NaN corners, infinite sides and areas, areas that
# overflow float32, degenerate and inverted boxes.
SPECIAL_BOXES = [
    (nan, 0.0, 10.0, 10.0),
    (0.0, 0.0, 10.0, nan),
    (0.0, 0.0, inf, 10.0),
    (-inf, -inf, inf, inf),
    (0.0, 0.0, inf, inf),
    (-inf, 0.0, 5.0, 5.0),
    (5.0, 5.0, 5.0, 9.0),
    (8.0, 2.0, 3.0, 9.0),
    (0.0, 0.0, 0.0, 0.0),
    (-3e38, 0.0, 3e38, 10.0),
    (0.0, 0.0, 3e38, 3e38),
    (-1.0, -1.0, 1e6, 1e6),
]
SPECIAL_SCORES = [0.0, -0.0, 1.0, inf, -inf, nan, 0.5]


def acc_dtype(dtype):
    """The dtype the kernels compute IoU in."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@st.composite
def tiles(draw, max_size=24):
    """(boxes, scores) of a few boxes, float64 lists."""
    m = draw(st.integers(1, max_size))
    boxes, scores = [], []
    for k in range(m):
        kind = draw(st.sampled_from(["int", "int", "int", "frac", "dup", "far", "special"]))
        if kind == "dup" and boxes:
            box = boxes[draw(st.integers(0, len(boxes) - 1))]
        elif kind == "special":
            box = draw(st.sampled_from(SPECIAL_BOXES))
        elif kind == "frac":
            x, y = (draw(st.floats(-20, 60, width=32)) for _ in range(2))
            w, h = (draw(st.floats(-2, 40, width=32)) for _ in range(2))
            box = (x, y, x + w, y + h)
        elif kind == "far":
            x, y = (draw(st.floats(1e4, 1e6)) for _ in range(2))
            w, h = (draw(st.sampled_from([0.0, 0.5, 1.0, 16.0, 1e3, 1e5])) for _ in range(2))
            box = (x, y, x + w, y + h)
        else:  # small integers: exact in every dtype, touching, nested and equal boxes, exact IoUs
            x, y = draw(st.integers(-8, 40)), draw(st.integers(-8, 40))
            w, h = draw(st.integers(-2, 16)), draw(st.integers(-2, 16))
            box = (float(x), float(y), float(x + w), float(y + h))
        boxes.append(tuple(box))
        skind = draw(st.sampled_from(["tie", "tie", "float", "float", "special"]))
        if skind == "tie":
            scores.append(float(draw(st.integers(0, 4))))
        elif skind == "float":
            scores.append(draw(st.floats(0, 1, width=32)))
        else:
            scores.append(draw(st.sampled_from(SPECIAL_SCORES)))
    return boxes, scores


# Sizes: mostly small; the CPU window and grid passes and the CUDA one-block limit sometimes;
# past the counting rank's limit rarely (CUDA only: the reference takes a while there).
SIZE_TIERS = {
    "cpu": ["small"] * 5 + ["window"] * 2 + ["grid"] * 2,
    "cuda": ["small"] * 5 + ["window"] * 2 + ["grid"] * 2 + ["block", "count"],
}
SIZE_RANGES = {
    "small": (0, WINDOW_MIN - 1),
    "window": (WINDOW_MIN, 700),
    "grid": (GRID_MIN, 2600),
    "block": (MAX_BLOCK_PASS - 2, MAX_BLOCK_PASS + 300),
    "count": (MAX_COUNT_RANK - 1, MAX_COUNT_RANK + 700),
}


@st.composite
def sizes(draw, device):
    tier = draw(st.sampled_from(SIZE_TIERS[device_type(device)]))
    event(f"size: {tier}")
    lo, hi = SIZE_RANGES[tier]
    return draw(st.integers(lo, hi))


def device_type(device):
    return torch.device(device).type


@st.composite
def box_sets(draw, n, score_steps=(0.0, 0.0, 1 / 64, 1e-3, -1 / 64)):
    """float64 boxes [n, 4] and scores [n]: a drawn tile repeated on a lattice of copies (step 0:
    identical copies; small steps: copies overlapping their neighbours in chains), copy c's
    scores lowered by c * score_step (0: ties across copies), then scaled and moved."""
    tile_boxes, tile_scores = draw(tiles())
    m = len(tile_boxes)
    tb = torch.tensor(tile_boxes, dtype=torch.float64)
    ts = torch.tensor(tile_scores, dtype=torch.float64)
    copies = -(-n // m)
    cols = draw(st.integers(1, 48))
    step = draw(st.sampled_from([0.0, 0.5, 1.0, 3.0, 8.0, 25.0, 200.0]))
    c = torch.arange(copies, dtype=torch.float64)
    offset = torch.stack([(c % cols) * step, torch.div(c, cols, rounding_mode="floor") * step], 1).repeat(1, 2)
    boxes = (tb[None] + offset[:, None]).reshape(-1, 4)[:n]
    score_step = draw(st.sampled_from(score_steps))
    scores = (ts[None] - c[:, None] * score_step).reshape(-1)[:n]
    scale = draw(st.sampled_from([1.0, 1.0, 1.0, 2.0**-12, 2.0**12, 1e4, 3.3e-3]))
    shift = draw(st.sampled_from([0.0, 0.0, 0.0, 1e4, 1e6, -5e5]))
    return boxes * scale + shift, scores


LAYOUTS = st.sampled_from(["contiguous", "contiguous", "column-major", "strided"])


def laid_out(t, layout):
    """t (on its device) as a non-contiguous view with the same values, or as it is."""
    if layout == "contiguous":
        return t
    if layout == "column-major" and t.dim() >= 2:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    return torch.stack([t, torch.full_like(t, 7.0)], -1)[..., 0]  # every other element


@st.composite
def thresholds(draw, boxes):
    """An IoU threshold: 0, 1, beyond them, anywhere between, or the IoU of a drawn pair of
    `boxes` (the kernels' arithmetic) or one rounding step beside it."""
    kind = draw(st.sampled_from(["fixed", "uniform", "pair", "pair", "outside"]))
    event(f"threshold: {kind}")
    if kind == "fixed":
        return draw(st.sampled_from([0.0, 1.0, 0.5, 0.7, 1e-7]))
    if kind == "uniform":
        return draw(st.floats(0, 1))
    if kind == "outside":
        return draw(st.sampled_from([-0.5, -1e-9, 1.0 + 1e-9, 2.0, 1e30]))
    n = boxes.size(0)
    if n < 2:
        return 0.5
    # mostly a pair that overlaps, among the first 64 boxes' pairs
    rows = torch.arange(min(n, 64))
    iou_all = ref.iou_rows(boxes, rows, torch.arange(n))
    overlapping = torch.nonzero((iou_all > 0) & torch.isfinite(iou_all))
    if overlapping.size(0) and draw(st.integers(0, 3)):
        i, j = overlapping[draw(st.integers(0, overlapping.size(0) - 1))].tolist()
    else:
        i, j = draw(st.integers(0, rows.numel() - 1)), draw(st.integers(0, n - 1))
    iou = iou_all[i, j]
    t = float(iou)
    if not math.isfinite(t):
        return 0.5
    nudge = draw(st.sampled_from(["exact", "exact", "double up", "double down", "float up", "float down"]))
    event(f"threshold: the IoU of a pair{'' if t > 0 else ' (0)'}, {nudge.split()[0]}")
    if nudge == "double up":
        t = math.nextafter(t, inf)
    elif nudge == "double down":
        t = math.nextafter(t, -inf)
    elif nudge.startswith("float"):
        direction = torch.tensor(inf if nudge == "float up" else -inf, dtype=iou.dtype)
        t = float(torch.nextafter(iou, direction))
    return t


@st.composite
def nms_inputs(draw, device):
    """(boxes, scores, iou_threshold) on `device`, with the boxes' and scores' dtypes and layouts
    drawn; the threshold from the boxes as given to the op."""
    n = draw(sizes(device))
    boxes64, scores64 = draw(box_sets(n))
    dtype = draw(st.sampled_from(DTYPES))
    sdtype = draw(st.sampled_from([dtype, dtype, dtype] + DTYPES))
    boxes, scores = boxes64.to(dtype), scores64.to(sdtype)
    threshold = draw(thresholds(boxes))
    boxes = laid_out(boxes.to(device), draw(LAYOUTS))
    scores = laid_out(scores.to(device), draw(LAYOUTS))
    note(f"n={n} boxes {dtype} scores {sdtype} threshold {threshold!r}")
    event(f"dtypes: boxes {str(dtype)[6:]}, scores {'the same' if sdtype == dtype else str(sdtype)[6:]}")
    return boxes, scores, threshold


@st.composite
def categories(draw, n, device):
    """idxs [n]: a few categories (one, or many), of an integer dtype, sometimes far apart."""
    k = draw(st.sampled_from([1, 2, 3, 5, 12]))
    idx_dtype = draw(st.sampled_from([torch.int64, torch.int64, torch.int32, torch.uint8, torch.int16]))
    pattern = draw(st.sampled_from(["blocks", "interleaved", "stride"]))
    i = torch.arange(n)
    if pattern == "blocks":
        idxs = torch.div(i * k, max(n, 1), rounding_mode="floor")
    elif pattern == "interleaved":
        idxs = i % k
    else:
        idxs = torch.div(i, draw(st.integers(1, 40)), rounding_mode="floor") % k
    if idx_dtype == torch.int64 and draw(st.booleans()):
        # categories near the ends of int64: no offset trick could separate them
        values = torch.tensor([torch.iinfo(torch.int64).min, -(2**62), 0, 2**62, torch.iinfo(torch.int64).max])
        idxs = values[idxs % 5]
    elif idx_dtype != torch.uint8 and draw(st.booleans()):
        idxs = idxs - 2
    return laid_out(idxs.to(idx_dtype).to(device), draw(LAYOUTS))


def torchvision_defines(boxes, scores):
    """torchvision's CPU nms (float32 / float64, scores of the boxes' dtype) computes the
    same IoU as detops for these inputs, and ranks them alike: no NaN score (torchvision keeps
    those), scores exact in the boxes' accumulation dtype."""
    if torch.isnan(scores).any():
        return False
    return scores.dtype != torch.float64 or boxes.dtype == torch.float64


def torchvision_nms(boxes, scores, threshold):
    acc = acc_dtype(boxes.dtype)
    return torchvision.ops.nms(boxes.cpu().to(acc), scores.cpu().to(acc), threshold)


def check_order(keep, boxes, scores):
    """keep: int64 indices of distinct boxes with numeric scores, by decreasing score, equal
    scores by increasing index."""
    keep = keep.cpu()
    assert keep.dtype == torch.int64 and keep.dim() == 1
    assert keep.unique().numel() == keep.numel()
    assert bool(((keep >= 0) & (keep < boxes.size(0))).all())
    s = scores.cpu().double()[keep]
    assert not bool(torch.isnan(s).any())
    assert bool((s[:-1] >= s[1:]).all())
    ties = s[:-1] == s[1:]
    assert bool((keep[:-1][ties] < keep[1:][ties]).all())


def per_category(boxes, scores, idxs, threshold):
    """detops nms run per category, combined: by decreasing score, ties by index."""
    cls = idxs.cpu().long()
    parts = [torch.empty(0, dtype=torch.int64)]
    for c in torch.unique(cls).tolist():
        sel = torch.nonzero(cls == c).flatten().to(boxes.device)
        parts.append(sel.cpu()[nms(boxes[sel], scores[sel], threshold).cpu()])
    kept = torch.sort(torch.cat(parts)).values
    order = torch.sort(scores.cpu().double()[kept], descending=True, stable=True).indices
    return kept[order]


def run_forced(fn, rank, pass_):
    with nms_kernel(rank, pass_):
        return fn()


@pytest.mark.parametrize("device", DEVICES)
@given(data=st.data())
def test_nms_matches_reference_and_torchvision(device, data):
    boxes, scores, threshold = data.draw(nms_inputs(device))
    keep = nms(boxes, scores, threshold)
    assert keep.device == boxes.device
    assert torch.equal(keep.cpu(), ref.nms(boxes.cpu(), scores.cpu(), threshold))
    check_order(keep, boxes, scores)
    if torchvision_defines(boxes, scores):
        assert torch.equal(keep.cpu(), torchvision_nms(boxes, scores, threshold))
    # detops' promise for NaN: a box with a NaN coordinate and a numeric score is kept; a box
    # with a NaN score is not, and suppresses nothing (without it the same boxes are kept)
    b64, s64 = boxes.cpu().double(), scores.cpu().double()
    nan_box = torch.isnan(b64).any(1) & ~torch.isnan(s64)
    assert bool(torch.isin(torch.nonzero(nan_box).flatten(), keep.cpu()).all())
    numeric = torch.nonzero(~torch.isnan(s64)).flatten()
    if numeric.numel() < s64.numel():
        on = numeric.to(boxes.device)
        assert torch.equal(on[nms(boxes[on], scores[on], threshold)], keep)
    # every kept box survives NMS among the kept ones (greedy NMS is idempotent)
    again = nms(boxes[keep], scores[keep], threshold)
    assert torch.equal(again.cpu(), torch.arange(keep.numel()))
    if device_type(device) == "cpu":
        n = boxes.size(0)
        event(f"cpu pass: {'dense' if n < WINDOW_MIN or threshold < 0 else 'window' if n < GRID_MIN else 'grid'}")
        if n > GRID_MIN:
            # the grid pass decides serially on one thread, by blocks of boxes on several
            for threads in (1, 2):
                assert torch.equal(with_threads(threads, lambda: nms(boxes, scores, threshold)), keep)
    if device_type(device) == "cuda":
        assert torch.equal(keep.cpu(), nms(boxes.cpu(), scores.cpu(), threshold))
        for rank in RANKS:
            for pass_ in PASSES:
                got = run_forced(lambda: nms(boxes, scores, threshold), rank, pass_)
                assert torch.equal(got, keep), (rank, pass_)


@pytest.mark.parametrize("device", DEVICES)
@given(data=st.data())
def test_batched_nms_is_per_category_nms(device, data):
    boxes, scores, threshold = data.draw(nms_inputs(device))
    idxs = data.draw(categories(boxes.size(0), device))
    keep = batched_nms(boxes, scores, idxs, threshold)
    assert keep.device == boxes.device
    check_order(keep, boxes, scores)
    assert torch.equal(keep.cpu(), ref.batched_nms(boxes.cpu(), scores.cpu(), idxs.cpu(), threshold))
    assert torch.equal(keep.cpu(), per_category(boxes, scores, idxs, threshold))
    if torchvision_defines(boxes, scores):
        # per category, torchvision's NMS keeps the same boxes
        cls = idxs.cpu().long()
        kept_cls = cls[keep.cpu()]
        for c in torch.unique(cls).tolist():
            sel = torch.nonzero(cls == c).flatten()
            expected = sel[torchvision_nms(boxes.cpu()[sel], scores.cpu()[sel], threshold)]
            assert torch.equal(keep.cpu()[kept_cls == c], expected), c
    one = torch.zeros_like(idxs)
    assert torch.equal(batched_nms(boxes, scores, one, threshold), nms(boxes, scores, threshold))
    if device_type(device) == "cpu" and boxes.size(0) > GRID_MIN:
        for threads in (1, 2):
            assert torch.equal(with_threads(threads, lambda: batched_nms(boxes, scores, idxs, threshold)), keep)
    if device_type(device) == "cuda":
        assert torch.equal(keep.cpu(), batched_nms(boxes.cpu(), scores.cpu(), idxs.cpu(), threshold))
        for rank in RANKS:
            for pass_ in PASSES:
                got = run_forced(lambda: batched_nms(boxes, scores, idxs, threshold), rank, pass_)
                assert torch.equal(got, keep), (rank, pass_)


@st.composite
def padded_inputs(draw, device):
    """(boxes [B, N, 4], scores [B, N], iou_threshold, score_threshold, max_output)."""
    batch = draw(st.integers(0, 3))
    tier = draw(st.sampled_from(["small"] * 5 + ["window"] * 2 + (["count"] if device_type(device) == "cuda" else [])))
    lo, hi = SIZE_RANGES[tier]
    n = draw(st.integers(lo, hi if tier != "count" else lo + 40))
    if tier == "count":
        batch = min(batch, 1)
    parts = [draw(box_sets(n)) for _ in range(batch)]
    boxes64 = torch.stack([p[0] for p in parts]) if parts else torch.empty(0, n, 4, dtype=torch.float64)
    scores64 = torch.stack([p[1] for p in parts]) if parts else torch.empty(0, n, dtype=torch.float64)
    dtype = draw(st.sampled_from(DTYPES))
    sdtype = draw(st.sampled_from([dtype, dtype, dtype] + DTYPES))
    boxes, scores = boxes64.to(dtype), scores64.to(sdtype)
    threshold = draw(thresholds(boxes[0] if batch else boxes.reshape(-1, 4)))
    skind = draw(st.sampled_from(["-inf", "-inf", "value", "value", "uniform", "other"]))
    finite = scores[torch.isfinite(scores)]
    if skind == "value" and finite.numel():
        # a score itself (the boundary: score > score_threshold) or one step beside it
        v = float(finite.reshape(-1)[draw(st.integers(0, finite.numel() - 1))])
        score_threshold = draw(st.sampled_from([v, v, math.nextafter(v, inf), math.nextafter(v, -inf)]))
    elif skind == "uniform":
        score_threshold = draw(st.floats(0, 1))
    elif skind == "other":
        score_threshold = draw(st.sampled_from([inf, 0.0, -0.0, -1e30, 3.0]))
    else:
        score_threshold = -inf
    max_output = draw(st.sampled_from([0, 1, 2, 7, 64, 65, 100, n, n + 3]))
    boxes = laid_out(boxes.to(device), draw(LAYOUTS))
    scores = laid_out(scores.to(device), draw(LAYOUTS))
    event(f"nms_padded: B={batch}, N {tier}")
    note(f"B={batch} N={n} boxes {dtype} scores {sdtype} iou {threshold!r} score {score_threshold!r} max {max_output}")
    return boxes, scores, threshold, score_threshold, max_output


@pytest.mark.parametrize("device", DEVICES)
@given(data=st.data())
def test_nms_padded_rows_are_nms_per_image(device, data):
    boxes, scores, threshold, score_threshold, max_output = data.draw(padded_inputs(device))
    idx, counts = nms_padded(boxes, scores, threshold, score_threshold, max_output)
    batch, n = scores.shape
    assert idx.shape == (batch, max_output) and counts.shape == (batch,)
    assert idx.dtype == torch.int64 and counts.dtype == torch.int64
    assert idx.device == boxes.device and counts.device == boxes.device
    expected = ref_padded.nms_padded(boxes.cpu(), scores.cpu(), threshold, score_threshold, max_output)
    assert torch.equal(counts.cpu(), expected[1])
    assert torch.equal(idx.cpu(), expected[0])
    for b in range(batch):
        passing = torch.nonzero(ref_padded.score_mask(scores[b].cpu(), score_threshold)).flatten().to(boxes.device)
        keep = passing[nms(boxes[b][passing], scores[b][passing], threshold)][:max_output]
        k = int(counts[b])
        assert k == keep.numel()
        assert torch.equal(idx[b, :k], keep)
        assert bool((idx[b, k:] == -1).all())
        check_order(idx[b, :k], boxes[b], scores[b])
    if device_type(device) == "cuda":
        on_cpu = nms_padded(boxes.cpu(), scores.cpu(), threshold, score_threshold, max_output)
        assert torch.equal(idx.cpu(), on_cpu[0]) and torch.equal(counts.cpu(), on_cpu[1])
        for rank in RANKS:  # nms_padded: 'radix' is its automatic choice
            got = run_forced(lambda: nms_padded(boxes, scores, threshold, score_threshold, max_output), rank, "auto")
            assert torch.equal(got[0], idx) and torch.equal(got[1], counts), rank


def infinite_side_boxes():
    """Boxes (0, 3k, inf, 3k + 10), k = 0..3, with zero-size boxes between them, equal scores:
    every pair of the infinite boxes has an infinite intersection and union, IoU NaN. Then two
    boxes whose width, 6e38, overflows float32: IoU NaN too."""
    rows = []
    for k in range(4):
        rows.append([0.0, 3.0 * k, inf, 3.0 * k + 10])
        rows += [[0.0, 3.0 * k, 0.0, 3.0 * k]] * (10 if k < 3 else 0)
    overflow = torch.tensor([[-3e38, 0.0, 3e38, 10.0], [-3e38, 9.0, 3e38, 19.0]])
    return [(torch.tensor(rows), torch.zeros(len(rows)), [0, 11, 22, 33]), (overflow, torch.tensor([1.0, 0.5]), [0, 1])]


@pytest.mark.parametrize("device", DEVICES)
def test_nms_infinite_sides_negative_threshold(device):
    # A NaN IoU is never above the threshold, even a negative one: the infinite boxes are all
    # kept; each zero-size box has IoU 0 with the infinite box before it and goes.
    for boxes, scores, expected in infinite_side_boxes():
        keep = nms(boxes.to(device), scores.to(device), -0.5).cpu()
        assert keep.tolist() == expected
        assert torch.equal(keep, torchvision.ops.nms(boxes, scores, -0.5))
        idxs = torch.zeros(boxes.size(0), dtype=torch.int64, device=device)
        assert batched_nms(boxes.to(device), scores.to(device), idxs, -0.5).tolist() == expected


@pytest.mark.parametrize("case", [0, 1])
def test_reference_nms_infinite_sides_negative_threshold(case):
    boxes, scores, expected = infinite_side_boxes()[case]
    assert ref.nms(boxes, scores, -0.5).tolist() == expected


def test_nms_kernel_setting_round_trip():
    from detops import _C

    assert _C._set_nms_kernel("auto", "auto") == ("auto", "auto")
    with nms_kernel("radix", "dataflow"):
        assert _C._set_nms_kernel("sort", "block") == ("radix", "dataflow")
        with nms_kernel():
            assert _C._set_nms_kernel("auto", "auto") == ("auto", "auto")
        assert _C._set_nms_kernel("count", "block") == ("sort", "block")
    assert _C._set_nms_kernel() == ("auto", "auto")
    with pytest.raises(RuntimeError, match=r"_set_nms_kernel: rank must be 'auto', 'count', 'radix' or 'sort', got 'tile'"):
        _C._set_nms_kernel("tile", "auto")
    with pytest.raises(RuntimeError, match=r"_set_nms_kernel: pass_ must be 'auto', 'block' or 'dataflow', got 'x'"):
        _C._set_nms_kernel("auto", "x")
    assert _C._set_nms_kernel() == ("auto", "auto")


def test_nms_kernel_leaves_cpu_results_alone():
    # a chain: each box overlaps its neighbours only, so every other box is kept
    x = torch.arange(60, dtype=torch.float32) * 2.5
    boxes = torch.stack([x, torch.zeros(60), x + 10, torch.full((60,), 10.0)], 1)
    scores = torch.linspace(1.0, 0.1, 60)
    for rank in RANKS:
        for pass_ in PASSES:
            with nms_kernel(rank, pass_):
                assert torch.equal(nms(boxes, scores, 0.5), torch.arange(0, 60, 2))
