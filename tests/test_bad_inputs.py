"""The bad-input matrix: every registered op (detops.testing.registered_ops()) and every Python
wrapper against wrong ranks, wrong dtypes, tensors on different devices, bad batch indices,
RoIs with x2 < x1, output sizes <= 0, sampling ratios < -1, NaN thresholds, sizes whose
products pass 2^31 and non-finite boxes.

Each case (a row of CASES) names its op, builds the call for a device, and expects either an
error of a given type whose message holds the op's name and the argument's name (Raises), or
the documented behaviour (Holds: a check of the result), or, for a bad batch index on CUDA, a
device-side assertion that names the op (DeviceAssert; the CUDA kernels check indices without
a host sync, see docs/design.md).

No case may crash the process or hang: the rows of a device run in one child process with a
timeout, which reports each row's outcome; the test of a row reads its outcome, so a crash or
a hang fails the row that caused it (and the rows after it). A device assertion poisons the
CUDA context of its process, so each DeviceAssert row runs in a child process of its own.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import traceback
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
import torchvision

import detops
from detops.ops import MultiScaleRoIAlign, RoIAlign, RoIPool, batched_nms, nms, nms_padded, roi_align, roi_pool
from detops.reference.nms import batched_nms as ref_batched_nms
from detops.reference.nms import nms as ref_nms
from detops.reference.nms_padded import nms_padded as ref_nms_padded
from detops.testing import registered_ops
from tests.conftest import assert_fails_device_assert

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
D = torch.ops.detops

# The name each op's messages give it.
OP_NAMES = {
    "nms": "detops.nms",
    "batched_nms": "detops.batched_nms",
    "nms_padded": "detops.nms_padded",
    "roi_align": "detops.roi_align",
    "_roi_align_backward": "detops._roi_align_backward",
    "roi_pool": "detops.roi_pool",
    "_roi_pool_values": "detops.roi_pool",
    "_roi_pool_backward": "detops.roi_pool backward",
    "_to_channels_last": "detops._to_channels_last",
    "ops.nms": "detops.nms",
    "ops.batched_nms": "detops.batched_nms",
    "ops.nms_padded": "detops.nms_padded",
    "ops.roi_align": "detops.roi_align",
    "ops.RoIAlign": "detops.roi_align",
    "ops.roi_pool": "detops.roi_pool",
    "ops.RoIPool": "detops.roi_pool",
    "ops.MultiScaleRoIAlign": "detops.MultiScaleRoIAlign",
}
WRAPPERS = [name for name in OP_NAMES if name.startswith("ops.")]


@dataclass
class Raises:
    """The call raises `exc` (or a subclass) with every word of `words` in its message (the
    op's name is added from OP_NAMES unless `op_name` says otherwise)."""

    exc: type
    words: Tuple[str, ...]
    op_name: Optional[str] = None


@dataclass
class Holds:
    """The call returns, and check(result, device) passes (the documented behaviour)."""

    check: Callable


@dataclass
class DeviceAssert:
    """On CUDA: the call fails with a device-side assertion whose text holds `words`."""

    words: Tuple[str, ...]


@dataclass
class Case:
    op: str
    name: str
    call: Callable  # device -> result
    expect: object
    devices: Tuple[str, ...] = ("cpu", "cuda")
    id: str = field(default="", init=False)


CASES: List[Case] = []


def case(op, name, call, expect, devices=("cpu", "cuda")):
    CASES.append(Case(op, name, call, expect, tuple(devices)))


def fail(message):
    raise AssertionError(message)


def raises(*words, exc=RuntimeError, op_name=None):
    return Raises(exc, tuple(words), op_name)


# --- inputs -------------------------------------------------------------------------------------


def gen(seed):
    return torch.Generator().manual_seed(seed)


def feat(dev, dtype=torch.float32, shape=(2, 3, 10, 12)):
    return torch.randn(*shape, generator=gen(0)).to(dev, dtype)


def rois(dev, dtype=torch.float32, rows=None):
    rows = rows if rows is not None else [[0, 1.0, 1.5, 6.0, 7.5], [1, 2.0, 0.5, 11.0, 9.0], [0, 4.0, 4.0, 5.0, 5.0]]
    return torch.tensor(rows, dtype=torch.float64).to(dev, dtype)


def boxes(dev, n=6, dtype=torch.float32):
    g = gen(1)
    xy = torch.rand(n, 2, generator=g) * 20
    return torch.cat([xy, xy + 4 + torch.rand(n, 2, generator=g) * 10], 1).to(dev, dtype)


def scores(dev, n=6, dtype=torch.float32):
    return torch.rand(n, generator=gen(2)).to(dev, dtype)


def idxs(dev, n=6):
    return torch.tensor([0, 1, 0, 1, 2, 0][:n] + [0] * max(0, n - 6), dtype=torch.int64, device=dev)


# Full calls of the registered ops; every argument can be replaced.
ALIGN = dict(spatial_scale=1.0, pooled_height=2, pooled_width=3, sampling_ratio=2, aligned=False)


def align(dev, input=None, rois_=None, **kw):
    a = {**ALIGN, **kw}
    return D.roi_align(
        feat(dev) if input is None else input, rois(dev) if rois_ is None else rois_, a["spatial_scale"],
        a["pooled_height"], a["pooled_width"], a["sampling_ratio"], a["aligned"],
    )


def align_grad(dev, k=3, c=3, ph=2, pw=3, dtype=torch.float32):
    return torch.randn(k, c, ph, pw, generator=gen(3)).to(dev, dtype)


def align_bwd(dev, grad=None, rois_=None, batch_size=2, channels=3, height=10, width=12, **kw):
    a = {**ALIGN, **kw}
    return D._roi_align_backward(
        align_grad(dev, ph=a["pooled_height"], pw=a["pooled_width"]) if grad is None else grad,
        rois(dev) if rois_ is None else rois_, a["spatial_scale"], a["pooled_height"], a["pooled_width"],
        batch_size, channels, height, width, a["sampling_ratio"], a["aligned"],
    )


POOL = dict(spatial_scale=1.0, pooled_height=2, pooled_width=3)


def pool(dev, input=None, rois_=None, values=False, **kw):
    a = {**POOL, **kw}
    fn = D._roi_pool_values if values else D.roi_pool
    return fn(
        feat(dev) if input is None else input, rois(dev) if rois_ is None else rois_, a["spatial_scale"],
        a["pooled_height"], a["pooled_width"],
    )


def pool_argmax(dev, rois_=None, ph=2, pw=3):
    return D.roi_pool(feat(dev), rois(dev) if rois_ is None else rois_, 1.0, ph, pw)[1]


def pool_bwd(dev, grad=None, rois_=None, argmax=None, batch_size=2, channels=3, height=10, width=12, **kw):
    a = {**POOL, **kw}
    ph, pw = a["pooled_height"], a["pooled_width"]
    r = rois(dev) if rois_ is None else rois_
    return D._roi_pool_backward(
        align_grad(dev, k=r.size(0), ph=ph, pw=pw) if grad is None else grad, r,
        pool_argmax(dev, None, max(ph, 1), max(pw, 1)) if argmax is None else argmax,
        a["spatial_scale"], ph, pw, batch_size, channels, height, width,
    )


def nms_op(dev, boxes_=None, scores_=None, iou_threshold=0.5):
    return D.nms(boxes(dev) if boxes_ is None else boxes_, scores(dev) if scores_ is None else scores_, iou_threshold)


def bnms_op(dev, boxes_=None, scores_=None, idxs_=None, iou_threshold=0.5):
    return D.batched_nms(
        boxes(dev) if boxes_ is None else boxes_, scores(dev) if scores_ is None else scores_,
        idxs(dev) if idxs_ is None else idxs_, iou_threshold,
    )


def pboxes(dev, dtype=torch.float32):
    return torch.stack([boxes(dev, dtype=dtype), boxes(dev, dtype=dtype).flip(0)])


def pscores(dev, dtype=torch.float32):
    return torch.stack([scores(dev, dtype=dtype), scores(dev, dtype=dtype).flip(0)])


def nmsp_op(dev, boxes_=None, scores_=None, iou_threshold=0.5, score_threshold=0.1, max_output=4):
    return D.nms_padded(
        pboxes(dev) if boxes_ is None else boxes_, pscores(dev) if scores_ is None else scores_,
        iou_threshold, score_threshold, max_output,
    )


# The tensor arguments of each registered op: (name, default builder, replace keyword, kind);
# kind "float" takes the float dtypes, "index" an integer dtype (idxs), "argmax" int32.
TENSOR_ARGS = {
    "nms": (nms_op, [("boxes", boxes, "boxes_", "float"), ("scores", scores, "scores_", "float")]),
    "batched_nms": (
        bnms_op,
        [("boxes", boxes, "boxes_", "float"), ("scores", scores, "scores_", "float"), ("idxs", idxs, "idxs_", "index")],
    ),
    "nms_padded": (nmsp_op, [("boxes", pboxes, "boxes_", "float"), ("scores", pscores, "scores_", "float")]),
    "roi_align": (align, [("input", feat, "input", "float"), ("rois", rois, "rois_", "float")]),
    "_roi_align_backward": (align_bwd, [("grad", align_grad, "grad", "float"), ("rois", rois, "rois_", "float")]),
    "roi_pool": (pool, [("input", feat, "input", "float"), ("rois", rois, "rois_", "float")]),
    "_roi_pool_values": (
        lambda dev, **kw: pool(dev, values=True, **kw),
        [("input", feat, "input", "float"), ("rois", rois, "rois_", "float")],
    ),
    "_roi_pool_backward": (
        pool_bwd,
        [("grad", align_grad, "grad", "float"), ("rois", rois, "rois_", "float"), ("argmax", pool_argmax, "argmax", "argmax")],
    ),
    "_to_channels_last": (lambda dev, input=None: D._to_channels_last(feat(dev) if input is None else input), [("input", feat, "input", "any")]),
}


# --- checks of documented behaviour -------------------------------------------------------------


def equal(expected_fn, exact=True):
    """Holds when the result equals expected_fn(device) (bitwise, or within the dtype's
    tolerance), tuples elementwise."""

    def check(result, dev):
        expected = expected_fn(dev)
        got = result if isinstance(result, (tuple, list)) else (result,)
        want = expected if isinstance(expected, (tuple, list)) else (expected,)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            w = w.to(g.device)
            if exact:
                assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, g.shape, w.dtype, w.shape)
                assert torch.equal(g, w), (g, w)
            else:
                torch.testing.assert_close(g, w.to(g.dtype))

    return check


def zeros_like_output(extra=None):
    """Holds when every value of the result (its first element for a tuple) is 0 (and
    extra(result) holds)."""

    def check(result, dev):
        out = result[0] if isinstance(result, (tuple, list)) else result
        assert torch.isfinite(out).all() and (out == 0).all(), out
        if extra is not None:
            extra(result)

    return check


def finite_output(result, dev):
    out = result[0] if isinstance(result, (tuple, list)) else result
    assert torch.isfinite(out).all(), out


def tv_roi_align(dev, rows, aligned, sampling_ratio, ph=2, pw=3):
    return torchvision.ops.roi_align(feat("cpu"), rois("cpu", rows=rows), (ph, pw), 1.0, sampling_ratio, aligned)


def tv_roi_align_grad(rows, aligned, sampling_ratio, ph=2, pw=3):
    x = feat("cpu").requires_grad_()
    out = torchvision.ops.roi_align(x, rois("cpu", rows=rows), (ph, pw), 1.0, sampling_ratio, aligned)
    out.backward(align_grad("cpu", k=len(rows), ph=ph, pw=pw))
    return x.grad


def tv_roi_pool_grad(rows, ph=2, pw=3):
    x = feat("cpu").requires_grad_()
    out = torchvision.ops.roi_pool(x, rois("cpu", rows=rows), (ph, pw), 1.0)
    out.backward(align_grad("cpu", k=len(rows), ph=ph, pw=pw))
    return x.grad


NAN, INF = float("nan"), float("inf")

# --- the generic rows of the registered ops: rank, dtype, devices -------------------------------


def _replace(op, kw, fn):
    call, _ = TENSOR_ARGS[op]
    return lambda dev: call(dev, **{kw: fn(dev)})


def _generic_rows():
    for op, (call, args) in TENSOR_ARGS.items():
        for name, build, kw, kind in args:
            # wrong rank: one dimension more, one fewer
            case(op, f"{name} rank +1", _replace(op, kw, lambda d, b=build: b(d).unsqueeze(0)), raises(name))
            case(op, f"{name} rank -1", _replace(op, kw, lambda d, b=build: b(d)[0]), raises(name))
            # wrong dtypes
            bad = {
                "float": [torch.int32, torch.int64, torch.bool],
                "index": [torch.float32, torch.bool],
                "argmax": [torch.int64, torch.float32, torch.bool],
                "any": [],
            }[kind]
            for dtype in bad:
                case(
                    op, f"{name} {str(dtype)[6:]}",
                    _replace(op, kw, lambda d, b=build, t=dtype: b(d).to(t)), raises(name),
                )
            if op == "_to_channels_last":
                continue
            # tensors on different devices: this argument on "meta" (the fake kernels), or on the
            # CPU while the others are on CUDA and the other way round
            case(op, f"{name} on meta", lambda d, b=build, kw=kw, c=call: c("cpu", **{kw: b("meta")}), raises(name), ("cpu",))
            case(op, f"{name} on cpu, others on cuda", lambda d, b=build, kw=kw, c=call: c("cuda", **{kw: b("cpu")}), raises(name), ("cuda",))
            case(op, f"{name} on cuda, others on cpu", lambda d, b=build, kw=kw, c=call: c("cpu", **{kw: b("cuda")}), raises(name), ("cuda",))


_generic_rows()

# _to_channels_last takes any dtype (documented): the values in channels_last.
for _dtype in (torch.int32, torch.bool):
    case(
        "_to_channels_last", f"input {str(_dtype)[6:]} (any dtype)",
        lambda d, t=_dtype: D._to_channels_last((feat(d) > 0).to(t)),
        Holds(lambda r, d, t=_dtype: (
            r.is_contiguous(memory_format=torch.channels_last)
            and torch.equal(r, (feat(d) > 0).to(t)) or fail("not the values in channels_last")
        )),
    )

# --- batch indices ------------------------------------------------------------------------------

BAD_BATCH = {
    "batch index out of range": 2.0,
    "batch index negative": -1.0,
    "batch index fractional": 0.5,
    "batch index nan": NAN,
}


def _bad_batch_rois(dev, value, dtype=torch.float32):
    r = rois(dev, dtype)
    r[1, 0] = value
    return r


ROI_OPS = {
    "roi_align": lambda d, r: align(d, rois_=r),
    "_roi_align_backward": lambda d, r: align_bwd(d, rois_=r),
    "roi_pool": lambda d, r: pool(d, rois_=r),
    "_roi_pool_values": lambda d, r: pool(d, rois_=r, values=True),
    "_roi_pool_backward": lambda d, r: pool_bwd(d, rois_=r, argmax=pool_argmax(d)),
    "ops.roi_align": lambda d, r: roi_align(feat(d), r, (2, 3), 1.0, 2),
    "ops.RoIAlign": lambda d, r: RoIAlign((2, 3), 1.0, 2)(feat(d), r),
    "ops.roi_pool": lambda d, r: roi_pool(feat(d), r, (2, 3), 1.0),
    "ops.RoIPool": lambda d, r: RoIPool((2, 3), 1.0)(feat(d), r),
}
for _op, _call in ROI_OPS.items():
    for _what, _value in BAD_BATCH.items():
        _make = lambda d, c=_call, v=_value: c(d, _bad_batch_rois(d, v))
        case(_op, _what, _make, raises("rois"), ("cpu",))
        # On CUDA a device-side assertion (docs/design.md): each registered op with every kind
        # of bad index, each wrapper with one
        if not _op.startswith("ops.") or _what == "batch index out of range":
            case(_op, f"{_what}, device assertion", _make, DeviceAssert(("rois[:, 0]",)), ("cuda",))

# --- RoIs with x2 < x1 (and y2 < y1): torchvision's rules ------------------------------------------

# Without `aligned` such a RoI counts as 1 x 1; with it, its size is negative (or 0): a fixed
# sampling ratio places samples backwards as torchvision does, and the adaptive grid is 0, so
# the RoI pools to zeros (torchvision's CPU kernel raises there, sizing a vector by the negative
# sample count).
BACKWARDS = [[0, 6.0, 7.0, 1.0, 1.0], [1, 9.0, 2.0, 2.0, 8.0], [0, 3.0, 3.0, 3.0, 3.0]]
for _aligned in (False, True):
    for _sr in (2, 0):
        _tag = f"aligned={_aligned} sampling_ratio={_sr}"
        _zeros = _aligned and _sr == 0
        case(
            "roi_align", f"x2 < x1, {_tag}",
            lambda d, a=_aligned, s=_sr: align(d, rois_=rois(d, rows=BACKWARDS), aligned=a, sampling_ratio=s),
            Holds(zeros_like_output() if _zeros else equal(lambda d, a=_aligned, s=_sr: tv_roi_align(d, BACKWARDS, a, s), exact=False)),
        )
        case(
            "_roi_align_backward", f"x2 < x1, {_tag}",
            lambda d, a=_aligned, s=_sr: align_bwd(d, rois_=rois(d, rows=BACKWARDS), aligned=a, sampling_ratio=s),
            Holds(zeros_like_output() if _zeros else equal(lambda d, a=_aligned, s=_sr: tv_roi_align_grad(BACKWARDS, a, s), exact=False)),
        )
    case(
        "ops.roi_align", f"x2 < x1, aligned={_aligned}",
        lambda d, a=_aligned: roi_align(feat(d), rois(d, rows=BACKWARDS), (2, 3), 1.0, 0, a),
        Holds(zeros_like_output() if _aligned else equal(lambda d: tv_roi_align(d, BACKWARDS, False, 0), exact=False)),
    )
    case(
        "ops.RoIAlign", f"x2 < x1, aligned={_aligned}",
        lambda d, a=_aligned: RoIAlign((2, 3), 1.0, 2, a)(feat(d), rois(d, rows=BACKWARDS)),
        Holds(equal(lambda d, a=_aligned: tv_roi_align(d, BACKWARDS, a, 2), exact=False)),
    )
for _op, _fn in {
    "roi_pool": lambda d: pool(d, rois_=rois(d, rows=BACKWARDS))[0],
    "_roi_pool_values": lambda d: pool(d, rois_=rois(d, rows=BACKWARDS), values=True),
    "ops.roi_pool": lambda d: roi_pool(feat(d), rois(d, rows=BACKWARDS), (2, 3), 1.0),
    "ops.RoIPool": lambda d: RoIPool((2, 3), 1.0)(feat(d), rois(d, rows=BACKWARDS)),
}.items():
    case(
        _op, "x2 < x1", _fn,
        Holds(equal(lambda d: torchvision.ops.roi_pool(feat("cpu"), rois("cpu", rows=BACKWARDS), (2, 3), 1.0))),
    )
case(
    "_roi_pool_backward", "x2 < x1",
    lambda d: pool_bwd(d, rois_=rois(d, rows=BACKWARDS), argmax=pool_argmax(d, rois(d, rows=BACKWARDS))),
    Holds(equal(lambda d: tv_roi_pool_grad(BACKWARDS))),
)

# --- output_size <= 0, sampling_ratio < -1, spatial_scale ----------------------------------------

for _ph, _pw in ((0, 3), (2, 0), (-1, 3), (2, -5)):
    _size = f"pooled size {_ph}x{_pw}"
    case("roi_align", _size, lambda d, a=_ph, b=_pw: align(d, pooled_height=a, pooled_width=b), raises("pooled_height"))
    case(
        "_roi_align_backward", _size,
        lambda d, a=_ph, b=_pw: align_bwd(d, grad=align_grad(d, ph=max(a, 0), pw=max(b, 0)), pooled_height=a, pooled_width=b),
        raises("pooled_height"),
    )
    case("roi_pool", _size, lambda d, a=_ph, b=_pw: pool(d, pooled_height=a, pooled_width=b), raises("pooled_height"))
    case("_roi_pool_values", _size, lambda d, a=_ph, b=_pw: pool(d, values=True, pooled_height=a, pooled_width=b), raises("pooled_height"))
    case(
        "_roi_pool_backward", _size,
        lambda d, a=_ph, b=_pw: pool_bwd(
            d, grad=align_grad(d, ph=max(a, 0), pw=max(b, 0)),
            argmax=torch.zeros(3, 3, max(a, 0), max(b, 0), dtype=torch.int32, device=d), pooled_height=a, pooled_width=b,
        ),
        raises("pooled_height"),
    )
for _size in (0, (2, 0), (-1, 3)):
    case("ops.roi_align", f"output_size {_size}", lambda d, s=_size: roi_align(feat(d), rois(d), s), raises("pooled_height"))
    case("ops.RoIAlign", f"output_size {_size}", lambda d, s=_size: RoIAlign(s, 1.0, 2)(feat(d), rois(d)), raises("pooled_height"))
    case("ops.roi_pool", f"output_size {_size}", lambda d, s=_size: roi_pool(feat(d), rois(d), s), raises("pooled_height"))
    case("ops.RoIPool", f"output_size {_size}", lambda d, s=_size: RoIPool(s, 1.0)(feat(d), rois(d)), raises("pooled_height"))
    case(
        "ops.MultiScaleRoIAlign", f"output_size {_size}",
        lambda d, s=_size: MultiScaleRoIAlign(["p2", "p3"], s, 2)(*fpn(d)), raises("pooled_height", op_name="detops.roi_align"),
    )
# output sizes that are not integers: an error, not a truncation
for _size in ((2.5, 3), ("a", 2), 2.5, None):
    for _op, _fn in {
        "ops.roi_align": lambda d, s: roi_align(feat(d), rois(d), s),
        "ops.RoIAlign": lambda d, s: RoIAlign(s, 1.0, 2)(feat(d), rois(d)),
        "ops.roi_pool": lambda d, s: roi_pool(feat(d), rois(d), s),
        "ops.RoIPool": lambda d, s: RoIPool(s, 1.0)(feat(d), rois(d)),
        "ops.MultiScaleRoIAlign": lambda d, s: MultiScaleRoIAlign(["p2"], s, 2),
    }.items():
        case(_op, f"output_size {_size!r}", lambda d, f=_fn, s=_size: f(d, s), raises("output_size", exc=ValueError))

# sampling_ratio <= 0 is adaptive (documented): -2, -100 and -2^40 give sampling_ratio 0's result
for _sr in (-2, -100, -(2**40)):
    case(
        "roi_align", f"sampling_ratio {_sr}", lambda d, s=_sr: align(d, sampling_ratio=s),
        Holds(equal(lambda d: align(d, sampling_ratio=0))),
    )
    case(
        "_roi_align_backward", f"sampling_ratio {_sr}", lambda d, s=_sr: align_bwd(d, sampling_ratio=s),
        Holds(equal(lambda d: align_bwd(d, sampling_ratio=0))),
    )
    case(
        "ops.roi_align", f"sampling_ratio {_sr}", lambda d, s=_sr: roi_align(feat(d), rois(d), (2, 3), 1.0, s),
        Holds(equal(lambda d: align(d, sampling_ratio=0))),
    )
    case(
        "ops.RoIAlign", f"sampling_ratio {_sr}", lambda d, s=_sr: RoIAlign((2, 3), 1.0, s)(feat(d), rois(d)),
        Holds(equal(lambda d: align(d, sampling_ratio=0))),
    )
    case(
        "ops.MultiScaleRoIAlign", f"sampling_ratio {_sr}", lambda d, s=_sr: MultiScaleRoIAlign(["p2", "p3"], 2, s)(*fpn(d)),
        Holds(equal(lambda d: MultiScaleRoIAlign(["p2", "p3"], 2, 0)(*fpn(d)))),
    )
case("roi_align", "sampling_ratio 2^16 + 1", lambda d: align(d, sampling_ratio=2**16 + 1), raises("sampling_ratio"))
case(
    "_roi_align_backward", "sampling_ratio 2^16 + 1", lambda d: align_bwd(d, sampling_ratio=2**16 + 1), raises("sampling_ratio")
)
for _sr in (2.5, NAN, "2"):
    case(
        "ops.roi_align", f"sampling_ratio {_sr!r}", lambda d, s=_sr: roi_align(feat(d), rois(d), 2, 1.0, s),
        raises("sampling_ratio", exc=(ValueError, TypeError)),
    )
    case(
        "ops.RoIAlign", f"sampling_ratio {_sr!r}", lambda d, s=_sr: RoIAlign(2, 1.0, s),
        raises("sampling_ratio", exc=(ValueError, TypeError)),
    )
    case(
        "ops.MultiScaleRoIAlign", f"sampling_ratio {_sr!r}", lambda d, s=_sr: MultiScaleRoIAlign(["p2"], 2, s),
        raises("sampling_ratio", exc=(ValueError, TypeError)),
    )
for _scale in (0.0, -1.0, NAN, INF):
    case("roi_align", f"spatial_scale {_scale}", lambda d, s=_scale: align(d, spatial_scale=s), raises("spatial_scale"))
    case("_roi_align_backward", f"spatial_scale {_scale}", lambda d, s=_scale: align_bwd(d, spatial_scale=s), raises("spatial_scale"))
    case("roi_pool", f"spatial_scale {_scale}", lambda d, s=_scale: pool(d, spatial_scale=s), raises("spatial_scale"))
    case("_roi_pool_values", f"spatial_scale {_scale}", lambda d, s=_scale: pool(d, values=True, spatial_scale=s), raises("spatial_scale"))
    case("_roi_pool_backward", f"spatial_scale {_scale}", lambda d, s=_scale: pool_bwd(d, spatial_scale=s), raises("spatial_scale"))
    case("ops.roi_align", f"spatial_scale {_scale}", lambda d, s=_scale: roi_align(feat(d), rois(d), 2, s), raises("spatial_scale"))
    case("ops.roi_pool", f"spatial_scale {_scale}", lambda d, s=_scale: roi_pool(feat(d), rois(d), 2, s), raises("spatial_scale"))
case("ops.RoIAlign", "spatial_scale None", lambda d: RoIAlign(2, None, 2), raises("spatial_scale", exc=TypeError))
case("ops.RoIPool", "spatial_scale 'x'", lambda d: RoIPool(2, "x"), raises("spatial_scale", exc=TypeError))
case("_roi_align_backward", "negative grad_input size", lambda d: align_bwd(d, height=-1), raises("height"))
case("_roi_pool_backward", "negative grad_input size", lambda d: pool_bwd(d, width=-1), raises("width"))
case(
    "_roi_align_backward", "grad of the wrong shape", lambda d: align_bwd(d, grad=align_grad(d, c=4)), raises("grad")
)
case(
    "_roi_pool_backward", "argmax of the wrong shape",
    lambda d: pool_bwd(d, argmax=torch.zeros(3, 3, 2, 2, dtype=torch.int32, device=d)), raises("argmax"),
)
case(
    "_roi_pool_backward", "argmax out of range",
    lambda d: pool_bwd(d, argmax=torch.full((3, 3, 2, 3), 10 * 12, dtype=torch.int32)), raises("argmax"), ("cpu",),
)
case(
    "roi_align", "input and rois of different dtypes", lambda d: align(d, rois_=rois(d, torch.float64)), raises("input", "rois")
)
case("roi_pool", "input and rois of different dtypes", lambda d: pool(d, rois_=rois(d, torch.float16)), raises("input", "rois"))
case("roi_align", "rois [K, 4]", lambda d: align(d, rois_=rois(d)[:, 1:]), raises("rois"))
case("roi_pool", "rois [K, 6]", lambda d: pool(d, rois_=torch.cat([rois(d), rois(d)[:, :1]], 1)), raises("rois"))

# --- thresholds ---------------------------------------------------------------------------------

for _thr in (NAN, INF, -INF):
    case("nms", f"iou_threshold {_thr}", lambda d, t=_thr: nms_op(d, iou_threshold=t), raises("iou_threshold"))
    case("batched_nms", f"iou_threshold {_thr}", lambda d, t=_thr: bnms_op(d, iou_threshold=t), raises("iou_threshold"))
    case("nms_padded", f"iou_threshold {_thr}", lambda d, t=_thr: nmsp_op(d, iou_threshold=t), raises("iou_threshold"))
    case("ops.nms", f"iou_threshold {_thr}", lambda d, t=_thr: nms(boxes(d), scores(d), t), raises("iou_threshold"))
    case(
        "ops.batched_nms", f"iou_threshold {_thr}", lambda d, t=_thr: batched_nms(boxes(d), scores(d), idxs(d), t),
        raises("iou_threshold"),
    )
    case(
        "ops.nms_padded", f"iou_threshold {_thr}", lambda d, t=_thr: nms_padded(pboxes(d), pscores(d), t),
        raises("iou_threshold"),
    )
case("nms_padded", "score_threshold nan", lambda d: nmsp_op(d, score_threshold=NAN), raises("score_threshold"))
case("ops.nms_padded", "score_threshold nan", lambda d: nms_padded(pboxes(d), pscores(d), 0.5, NAN), raises("score_threshold"))
for _thr in (INF, -INF):  # documented: allowed; inf keeps nothing, -inf drops NaN and -inf scores
    case(
        "nms_padded", f"score_threshold {_thr}", lambda d, t=_thr: nmsp_op(d, score_threshold=t),
        Holds(equal(lambda d, t=_thr: ref_nms_padded(pboxes("cpu"), pscores("cpu"), 0.5, t, 4))),
    )
for _thr in (None, "0.5"):
    case("ops.nms", f"iou_threshold {_thr!r}", lambda d, t=_thr: nms(boxes(d), scores(d), t), raises("iou_threshold", exc=TypeError))
    case(
        "ops.batched_nms", f"iou_threshold {_thr!r}", lambda d, t=_thr: batched_nms(boxes(d), scores(d), idxs(d), t),
        raises("iou_threshold", exc=TypeError),
    )
    case(
        "ops.nms_padded", f"score_threshold {_thr!r}", lambda d, t=_thr: nms_padded(pboxes(d), pscores(d), 0.5, t),
        raises("score_threshold", exc=TypeError),
    )
case("nms_padded", "max_output -1", lambda d: nmsp_op(d, max_output=-1), raises("max_output"))
case("ops.nms_padded", "max_output -1", lambda d: nms_padded(pboxes(d), pscores(d), 0.5, max_output=-1), raises("max_output"))
for _m in (2.5, NAN, "3"):
    case(
        "ops.nms_padded", f"max_output {_m!r}", lambda d, m=_m: nms_padded(pboxes(d), pscores(d), 0.5, max_output=m),
        raises("max_output", exc=(ValueError, TypeError)),
    )
case("nms", "boxes and scores of different lengths", lambda d: nms_op(d, scores_=scores(d, 5)), raises("boxes", "scores"))
case("batched_nms", "idxs of another length", lambda d: bnms_op(d, idxs_=idxs(d, 5)), raises("idxs"))
case("nms_padded", "scores [B, N + 1]", lambda d: nmsp_op(d, scores_=torch.zeros(2, 7, device=d)), raises("scores"))
# idxs are categories: any integers, negative and huge included (documented: per-category NMS)
case(
    "batched_nms", "idxs negative and 2^62",
    lambda d: bnms_op(d, idxs_=torch.tensor([-3, 2**62, -3, 2**62, 0, 0], device=d)),
    Holds(equal(lambda d: ref_batched_nms(boxes("cpu"), scores("cpu"), torch.tensor([-3, 2**62, -3, 2**62, 0, 0]), 0.5))),
)
case(
    "batched_nms", "idxs uint8", lambda d: bnms_op(d, idxs_=idxs(d).to(torch.uint8)),
    Holds(equal(lambda d: ref_batched_nms(boxes("cpu"), scores("cpu"), idxs("cpu"), 0.5))),
)

# --- non-finite boxes ---------------------------------------------------------------------------

# NMS (documented in detops/ops/nms.py): a NaN score is never kept and suppresses nothing; a box
# with a NaN coordinate suppresses nothing and is never suppressed; infinite coordinates follow
# IEEE arithmetic. The reference implements these rules.
NF_BOXES = [[0.0, 0, 10, 10], [NAN, 0, 10, 10], [1, 1, 10, 10], [0, 0, INF, 10], [-INF, 0, 10, 10], [0, 0, 10, 10], [2, 2, 9, 9]]
NF_SCORES = [0.9, 0.95, 0.8, 0.7, NAN, 0.6, INF]
NF_IDXS = [0, 0, 1, 0, 1, 0, 1]


def nf(dev, rows, dtype=torch.float32):
    return torch.tensor(rows, dtype=torch.float64).to(dev, dtype)


for _dtype in (torch.float32, torch.float16):
    _t = str(_dtype)[6:]
    case(
        "nms", f"non-finite boxes and scores {_t}", lambda d, t=_dtype: D.nms(nf(d, NF_BOXES, t), nf(d, NF_SCORES, t), 0.3),
        Holds(equal(lambda d, t=_dtype: ref_nms(nf("cpu", NF_BOXES, t), nf("cpu", NF_SCORES, t), 0.3))),
    )
    case(
        "ops.nms", f"non-finite boxes and scores {_t}", lambda d, t=_dtype: nms(nf(d, NF_BOXES, t), nf(d, NF_SCORES, t), 0.3),
        Holds(equal(lambda d, t=_dtype: ref_nms(nf("cpu", NF_BOXES, t), nf("cpu", NF_SCORES, t), 0.3))),
    )
    for _op, _fn in {"batched_nms": D.batched_nms, "ops.batched_nms": batched_nms}.items():
        case(
            _op, f"non-finite boxes and scores {_t}",
            lambda d, t=_dtype, f=_fn: f(nf(d, NF_BOXES, t), nf(d, NF_SCORES, t), torch.tensor(NF_IDXS, device=d), 0.3),
            Holds(equal(lambda d, t=_dtype: ref_batched_nms(nf("cpu", NF_BOXES, t), nf("cpu", NF_SCORES, t), torch.tensor(NF_IDXS), 0.3))),
        )
    for _op, _fn in {"nms_padded": D.nms_padded, "ops.nms_padded": nms_padded}.items():
        case(
            _op, f"non-finite boxes and scores {_t}",
            lambda d, t=_dtype, f=_fn: f(nf(d, [NF_BOXES], t), nf(d, [NF_SCORES], t), 0.3, -INF, 5),
            Holds(equal(lambda d, t=_dtype: ref_nms_padded(nf("cpu", [NF_BOXES], t), nf("cpu", [NF_SCORES], t), 0.3, -INF, 5))),
        )

# RoIAlign (csrc/common/roi_align_geometry.h): a non-finite sample contributes nothing and the
# adaptive grid of a RoI whose size is not finite is 0, so such a RoI pools to zeros and passes
# no gradient. RoIPool (roi_pool_geometry.h): a NaN coordinate gives only empty bins (0, argmax
# -1); infinite coordinates are clamped to +-2^30 pixels.
NF_ROIS = {
    "nan x1": [[0, NAN, 1.0, 6.0, 7.0]],
    "nan y2": [[1, 1.0, 1.0, 6.0, NAN]],
    "inf x2": [[0, 1.0, 1.0, INF, 7.0]],
    "-inf y1": [[1, 1.0, -INF, 6.0, 7.0]],
    "all inf": [[0, -INF, -INF, INF, INF]],
}
for _what, _rows in NF_ROIS.items():
    for _aligned in (False, True):
        for _sr in (2, 0):
            _tag = f"{_what}, aligned={_aligned} sampling_ratio={_sr}"
            case(
                "roi_align", _tag,
                lambda d, r=_rows, a=_aligned, s=_sr: align(d, rois_=rois(d, rows=r), aligned=a, sampling_ratio=s),
                Holds(zeros_like_output()),
            )
            case(
                "_roi_align_backward", _tag,
                lambda d, r=_rows, a=_aligned, s=_sr: align_bwd(
                    d, grad=align_grad(d, k=1), rois_=rois(d, rows=r), aligned=a, sampling_ratio=s
                ),
                Holds(zeros_like_output()),
            )
    case("ops.roi_align", _what, lambda d, r=_rows: roi_align(feat(d), rois(d, rows=r), 2, 1.0, 0, True), Holds(zeros_like_output()))
    case("ops.RoIAlign", _what, lambda d, r=_rows: RoIAlign(2, 1.0, 2)(feat(d), rois(d, rows=r)), Holds(zeros_like_output()))
for _what in ("nan x1", "nan y2"):
    _rows = NF_ROIS[_what]
    case(
        "roi_pool", _what, lambda d, r=_rows: pool(d, rois_=rois(d, rows=r)),
        Holds(zeros_like_output(lambda res: (res[1] == -1).all() or fail("argmax is not -1"))),
    )
    case("_roi_pool_values", _what, lambda d, r=_rows: pool(d, rois_=rois(d, rows=r), values=True), Holds(zeros_like_output()))
    case("ops.roi_pool", _what, lambda d, r=_rows: roi_pool(feat(d), rois(d, rows=r), 2, 1.0), Holds(zeros_like_output()))
    case("ops.RoIPool", _what, lambda d, r=_rows: RoIPool(2, 1.0)(feat(d), rois(d, rows=r)), Holds(zeros_like_output()))
    case(
        "_roi_pool_backward", _what,
        lambda d, r=_rows: pool_bwd(d, grad=align_grad(d, k=1), rois_=rois(d, rows=r), argmax=pool_argmax(d, rois(d, rows=r))),
        Holds(zeros_like_output()),
    )
for _what in ("inf x2", "-inf y1", "all inf"):
    _rows = NF_ROIS[_what]
    _clamped = [[v if math.isfinite(v) else math.copysign(2.0**30, v) for v in row] for row in _rows]
    case(
        "roi_pool", _what, lambda d, r=_rows: pool(d, rois_=rois(d, rows=r)),
        Holds(equal(lambda d, c=_clamped: pool(d, rois_=rois(d, rows=c)))),
    )
    case(
        "_roi_pool_values", _what, lambda d, r=_rows: pool(d, rois_=rois(d, rows=r), values=True),
        Holds(equal(lambda d, c=_clamped: pool(d, rois_=rois(d, rows=c), values=True))),
    )
    case(
        "ops.roi_pool", _what, lambda d, r=_rows: roi_pool(feat(d), rois(d, rows=r), (2, 3), 1.0),
        Holds(equal(lambda d, c=_clamped: pool(d, rois_=rois(d, rows=c), values=True))),
    )
    case(
        "_roi_pool_backward", _what,
        lambda d, r=_rows: pool_bwd(d, grad=align_grad(d, k=1), rois_=rois(d, rows=r), argmax=pool_argmax(d, rois(d, rows=r))),
        Holds(equal(lambda d, c=_clamped: pool_bwd(d, grad=align_grad(d, k=1), rois_=rois(d, rows=c), argmax=pool_argmax(d, rois(d, rows=c))))),
    )
# huge finite RoIs: the adaptive grid is capped at kMaxGrid (2^16) samples per axis, so a bin
# has up to 2^32 samples; the CPU kernels visit only those on the map. (The CUDA rows are last
# in the table: should a CUDA kernel walk all of them and run past the child's time limit, only
# they fail.)
HUGE_FINITE = [[0, -1e30, -1e30, 1e30, 1e30], [1, 0.0, 0.0, 2.0**17, 2.0**17]]


def _huge_finite_rows(devices):
    case(
        "roi_align", f"huge finite RoI, adaptive grid [{devices[0]}]",
        lambda d: align(d, rois_=rois(d, rows=HUGE_FINITE), sampling_ratio=0), Holds(finite_output), devices,
    )
    case(
        "_roi_align_backward", f"huge finite RoI, adaptive grid [{devices[0]}]",
        lambda d: align_bwd(d, grad=align_grad(d, k=2), rois_=rois(d, rows=HUGE_FINITE), sampling_ratio=0),
        Holds(finite_output), devices,
    )


_huge_finite_rows(("cpu",))

# --- sizes whose products pass 2^31 -------------------------------------------------------------

# Output or gradient sizes beyond what a tensor can hold: an error naming the size arguments
# (not torch's allocator's message).
case("roi_align", "pooled size 2^32 x 2^32", lambda d: align(d, pooled_height=2**32, pooled_width=2**32), raises("pooled_height"))
case(
    "roi_align", "no RoIs, pooled size 2^32 x 2^32",
    lambda d: align(d, rois_=rois(d)[:0], pooled_height=2**32, pooled_width=2**32), raises("pooled_height"),
)
case("roi_pool", "pooled size 2^31 x 2^31", lambda d: pool(d, pooled_height=2**31, pooled_width=2**31), raises("pooled_height"))
case(
    "_roi_pool_values", "pooled size 2^40 x 2^40", lambda d: pool(d, values=True, pooled_height=2**40, pooled_width=2**40),
    raises("pooled_height"),
)
case(
    "ops.roi_align", "output_size 2^32", lambda d: roi_align(feat(d), rois(d), 2**32), raises("pooled_height")
)
case("ops.RoIPool", "output_size 2^32", lambda d: RoIPool(2**32, 1.0)(feat(d), rois(d)), raises("pooled_height"))
case(
    "ops.MultiScaleRoIAlign", "output_size 2^32", lambda d: MultiScaleRoIAlign(["p2", "p3"], 2**32, 2)(*fpn(d)),
    raises("pooled_height", op_name="detops.roi_align"),
)
for _sizes in ((2**32, 3, 2**32, 2**32), (2**20, 1, 2**21, 2**21)):
    case(
        "_roi_align_backward", f"grad_input {list(_sizes)}",
        lambda d, s=_sizes: align_bwd(d, batch_size=s[0], channels=s[1], height=s[2], width=s[3]),
        raises("batch_size"),
    )
    case(
        "_roi_align_backward", f"no RoIs, grad_input {list(_sizes)}",
        lambda d, s=_sizes: align_bwd(
            d, grad=align_grad(d, k=0, c=s[1]), rois_=rois(d)[:0], batch_size=s[0], channels=s[1], height=s[2], width=s[3]
        ),
        raises("batch_size"),
    )
    case(
        "_roi_pool_backward", f"no RoIs, grad_input {list(_sizes)}",
        lambda d, s=_sizes: pool_bwd(
            d, grad=align_grad(d, k=0, c=s[1]), rois_=rois(d)[:0],
            argmax=torch.zeros(0, s[1], 2, 3, dtype=torch.int32, device=d),
            batch_size=s[0], channels=s[1], height=s[2], width=s[3],
        ),
        raises("batch_size"),
    )
# Sizes a tensor can describe but memory cannot hold: the allocator's error, no crash
case(
    "_roi_align_backward", "grad_input [2^16, 3, 2^16, 2^16]",
    lambda d: align_bwd(d, batch_size=2**16, channels=3, height=2**16, width=2**16),
    raises("allocate", op_name=""),
)
case("nms_padded", "max_output 2^62", lambda d: nmsp_op(d, max_output=2**62), raises("max_output"))
case("ops.nms_padded", "max_output 2^61", lambda d: nms_padded(pboxes(d), pscores(d), 0.5, max_output=2**61), raises("max_output"))
# H * W >= 2^31 (argmax is int32): an expanded input, nothing allocated
case(
    "roi_pool", "input H * W = 2^31",
    lambda d: pool(d, input=torch.zeros(1, 1, 1, 1, device=d).expand(2, 3, 2**16, 2**15)), raises("input"),
)
case(
    "_roi_pool_values", "input H * W = 2^31",
    lambda d: pool(d, values=True, input=torch.zeros(1, 1, 1, 1, device=d).expand(2, 3, 2**16, 2**15)), raises("input"),
)
# CUDA's own limits, reached with expanded inputs (nothing allocated)
case(
    "nms", "N = 65535 * 64 + 1 boxes on CUDA",
    lambda d: D.nms(torch.zeros(1, 4, device=d).expand(65535 * 64 + 1, 4), torch.zeros(1, device=d).expand(65535 * 64 + 1), 0.5),
    raises("boxes"), ("cuda",),
)
case(
    "nms_padded", "suppression mask beyond the GPU's memory",
    lambda d: D.nms_padded(torch.zeros(1, 1, 4, device=d).expand(2**20, 4096, 4), torch.zeros(1, 1, device=d).expand(2**20, 4096), 0.5, -INF, 10),
    raises("boxes"), ("cuda",),
)


def huge_input(dev):
    """[3, 2^14, 256, 256] float16: 3 * 2^30 elements, image 2 starts past 2^31. Allocated
    without being written (its pages are mapped as they are touched), but channels 0, 1 and the
    last of image 2."""
    x = torch.empty(3, 2**14, 256, 256, dtype=torch.float16, device=dev)
    for c in (0, 1, -1):
        x[2, c] = torch.randn(256, 256, generator=gen(10 + c)).to(dev, torch.float16)
    return x


HUGE_ROIS = [[2, 10.0, 20.0, 30.0, 35.0], [2, 100.5, 3.0, 120.0, 25.0]]


def huge_case(fn):
    """fn(input, rois) on the huge input, channels (0, 1, last) against fn on those channels
    alone (image 0 of a small input)."""

    def call(dev):
        x = huge_input(dev)
        r = rois(dev, torch.float16, rows=HUGE_ROIS)
        out = fn(x, r)
        out = out[0] if isinstance(out, tuple) else out
        return out[:, [0, 1, -1]], fn(x[2:3, [0, 1, -1]].contiguous(), torch.cat([torch.zeros_like(r[:, :1]), r[:, 1:]], 1))

    def check(result, dev):
        got, want = result
        want = want[0] if isinstance(want, tuple) else want
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)

    return call, Holds(check)


for _op, _fn in {
    "roi_align": lambda x, r: D.roi_align(x, r, 1.0, 3, 3, 2, True),
    "roi_pool": lambda x, r: D.roi_pool(x, r, 1.0, 3, 3),
    "_roi_pool_values": lambda x, r: D._roi_pool_values(x, r, 1.0, 3, 3),
    "ops.roi_align": lambda x, r: roi_align(x, r, 3, 1.0, 2, False),
    "ops.roi_pool": lambda x, r: roi_pool(x, r, 3, 1.0),
}.items():
    _call, _expect = huge_case(_fn)
    case(_op, "input of 3 * 2^30 elements", _call, _expect)
# roi_pool reads any strided input: an input of 2^33 elements over overlapping planes of a
# small storage (channel c is storage[c : c + 2^16])
case(
    "roi_pool", "strided input of 2^33 elements",
    lambda d: (
        lambda x: (D.roi_pool(x, rois(d, rows=HUGE_ROIS[:1]), 1.0, 3, 3)[0][:, [0, 77777, -1]],
                   D.roi_pool(x[:, [0, 77777, -1]].contiguous(), rois(d, rows=HUGE_ROIS[:1]), 1.0, 3, 3)[0])
    )(torch.randn(2**17 + 2**16, generator=gen(11)).to(d).as_strided((3, 2**17, 256, 256), (0, 1, 256, 1))),
    Holds(lambda r, d: torch.equal(*r) or fail("strided and contiguous results differ")),
)
# IoU pairs past 2^31: 2^16 boxes (N^2 = 2^32; the CUDA kernels keep an N x N bit mask)
case(
    "nms", "N = 2^16 boxes (N^2 = 2^32 pairs)",
    lambda d: (lambda b, s: (D.nms(b.to(d), s.to(d), 0.5), D.nms(b, s, 0.5)))(*detops.testing.clustered_boxes(2**16, seed=5, clusters=4000)),
    Holds(lambda r, d: torch.equal(r[0].cpu(), r[1]) or fail("CUDA and CPU keep different boxes")), ("cuda",),
)

# --- the wrappers: rank, dtype, devices, lists of boxes -------------------------------------------


def fpn(dev, dtype=torch.float32, boxes_=None):
    feats = {
        "p2": torch.randn(2, 3, 32, 32, generator=gen(20)).to(dev, dtype),
        "p3": torch.randn(2, 3, 16, 16, generator=gen(21)).to(dev, dtype),
    }
    b = boxes_ if boxes_ is not None else [rois(dev, dtype)[:2, 1:] * 8, rois(dev, dtype)[2:, 1:] * 20]
    return feats, b, [(128, 128), (120, 128)]


WRAPPED = {
    "ops.roi_align": lambda x, b: roi_align(x, b, 2, 1.0, 2),
    "ops.RoIAlign": lambda x, b: RoIAlign(2, 1.0, 2)(x, b),
    "ops.roi_pool": lambda x, b: roi_pool(x, b, 2, 1.0),
    "ops.RoIPool": lambda x, b: RoIPool(2, 1.0)(x, b),
}
for _op, _fn in WRAPPED.items():
    case(_op, "input rank 3", lambda d, f=_fn: f(feat(d)[0], rois(d)), raises("input"))
    case(_op, "rois [K, 4]", lambda d, f=_fn: f(feat(d), rois(d)[:, 1:]), raises("rois"))
    case(_op, "input int32", lambda d, f=_fn: f(feat(d).int(), rois(d)), raises("input"))
    case(_op, "rois bool", lambda d, f=_fn: f(feat(d), rois(d).bool()), raises("rois"))
    case(_op, "boxes list of int64", lambda d, f=_fn: f(feat(d), [rois(d)[:2, 1:].long(), rois(d)[2:, 1:].long()]), raises("rois"))
    case(_op, "boxes list [L, 5]", lambda d, f=_fn: f(feat(d), [rois(d)]), raises("boxes", exc=ValueError))
    case(_op, "boxes empty list", lambda d, f=_fn: f(feat(d), []), raises("boxes", exc=ValueError))
    case(_op, "boxes a string", lambda d, f=_fn: f(feat(d), "boxes"), raises("boxes", exc=TypeError))
    case(_op, "rois on meta", lambda d, f=_fn: f(feat("cpu"), rois("meta")), raises("rois"), ("cpu",))
    case(_op, "input on meta", lambda d, f=_fn: f(feat("meta"), rois("cpu")), raises("input"), ("cpu",))
    case(
        _op, "boxes list on cpu and meta", lambda d, f=_fn: f(feat("cpu"), [rois("cpu")[:2, 1:], rois("meta")[2:, 1:]]),
        raises("boxes", exc=ValueError), ("cpu",),
    )
    case(_op, "rois on cpu, input on cuda", lambda d, f=_fn: f(feat("cuda"), rois("cpu")), raises("rois"), ("cuda",))
    case(_op, "input on cpu, rois on cuda", lambda d, f=_fn: f(feat("cpu"), rois("cuda")), raises("input"), ("cuda",))
    case(
        _op, "boxes list on cuda and cpu", lambda d, f=_fn: f(feat("cuda"), [rois("cuda")[:2, 1:], rois("cpu")[2:, 1:]]),
        raises("boxes", exc=ValueError), ("cuda",),
    )

NMS_WRAPPED = {
    "ops.nms": lambda b, s, i: nms(b, s, 0.5),
    "ops.batched_nms": lambda b, s, i: batched_nms(b, s, i, 0.5),
}
for _op, _fn in NMS_WRAPPED.items():
    case(_op, "boxes [N, 5]", lambda d, f=_fn: f(torch.zeros(6, 5, device=d), scores(d), idxs(d)), raises("boxes"))
    case(_op, "scores [N, 1]", lambda d, f=_fn: f(boxes(d), scores(d)[:, None], idxs(d)), raises("scores"))
    case(_op, "boxes int64", lambda d, f=_fn: f(boxes(d).long(), scores(d), idxs(d)), raises("boxes"))
    case(_op, "scores bool", lambda d, f=_fn: f(boxes(d), scores(d) > 0.5, idxs(d)), raises("scores"))
    case(_op, "scores on meta", lambda d, f=_fn: f(boxes("cpu"), scores("meta"), idxs("cpu")), raises("scores"), ("cpu",))
    case(_op, "scores on cpu, boxes on cuda", lambda d, f=_fn: f(boxes("cuda"), scores("cpu"), idxs("cuda")), raises("scores"), ("cuda",))
case("ops.batched_nms", "idxs float", lambda d: batched_nms(boxes(d), scores(d), idxs(d).float(), 0.5), raises("idxs"))
case("ops.batched_nms", "idxs on meta", lambda d: batched_nms(boxes("cpu"), scores("cpu"), idxs("meta"), 0.5), raises("idxs"), ("cpu",))
case("ops.batched_nms", "idxs on cpu", lambda d: batched_nms(boxes("cuda"), scores("cuda"), idxs("cpu"), 0.5), raises("idxs"), ("cuda",))
case("ops.nms_padded", "boxes [N, 4] (no batch)", lambda d: nms_padded(boxes(d), scores(d), 0.5), raises("boxes"))
case("ops.nms_padded", "scores float64 and boxes int32", lambda d: nms_padded(pboxes(d).int(), pscores(d).double(), 0.5), raises("boxes"))
case("ops.nms_padded", "scores bool", lambda d: nms_padded(pboxes(d), pscores(d) > 0.5, 0.5), raises("scores"))
case("ops.nms_padded", "scores on meta", lambda d: nms_padded(pboxes("cpu"), pscores("meta"), 0.5), raises("scores"), ("cpu",))
case("ops.nms_padded", "scores on cpu", lambda d: nms_padded(pboxes("cuda"), pscores("cpu"), 0.5), raises("scores"), ("cuda",))

# MultiScaleRoIAlign
MSRA_NAME = "detops.MultiScaleRoIAlign"


def msra(dev, names=("p2", "p3"), dtype=torch.float32, boxes_=None, sampling_ratio=2, **kw):
    feats, b, shapes = fpn(dev, dtype, boxes_)
    feats.update(kw.pop("feats", {}))
    return MultiScaleRoIAlign(list(names), 2, sampling_ratio)(feats, kw.pop("boxes", b), kw.pop("shapes", shapes))


def tv_msra(names, boxes_rows):
    feats, _, shapes = fpn("cpu")
    b = [torch.tensor(r, dtype=torch.float32) for r in boxes_rows]
    return torchvision.ops.MultiScaleRoIAlign(list(names), 2, 2)(feats, b, shapes)


case("ops.MultiScaleRoIAlign", "feature rank 3", lambda d: msra(d, feats={"p2": torch.zeros(3, 32, 32, device=d)}),
     raises("input", op_name="detops.roi_align"))
case("ops.MultiScaleRoIAlign", "feature int32", lambda d: msra(d, feats={"p2": torch.zeros(2, 3, 32, 32, dtype=torch.int32, device=d),
                                                                          "p3": torch.zeros(2, 3, 16, 16, dtype=torch.int32, device=d)}),
     raises("input", op_name="detops.roi_align"))
case("ops.MultiScaleRoIAlign", "boxes [L, 5]", lambda d: msra(d, boxes=[rois(d)]), raises("boxes", exc=ValueError))
case("ops.MultiScaleRoIAlign", "boxes a tensor", lambda d: msra(d, boxes=rois(d)), raises("boxes", exc=TypeError))
case("ops.MultiScaleRoIAlign", "boxes bool", lambda d: msra(d, boxes=[rois(d)[:, 1:] > 2]), raises("boxes", exc=ValueError))
case("ops.MultiScaleRoIAlign", "boxes int64", lambda d: msra(d, boxes=[rois(d)[:, 1:].long()]), raises("boxes", exc=ValueError))
case("ops.MultiScaleRoIAlign", "boxes float64, features float32", lambda d: msra(d, boxes=[rois(d, torch.float64)[:, 1:]]),
     raises("input", "rois", op_name="detops.roi_align"))
case("ops.MultiScaleRoIAlign", "boxes on meta", lambda d: msra("cpu", boxes=[rois("meta")[:, 1:]]), raises("boxes", exc=ValueError), ("cpu",))
case("ops.MultiScaleRoIAlign", "boxes on cpu", lambda d: msra("cuda", boxes=[rois("cpu")[:, 1:]]), raises("boxes", exc=ValueError), ("cuda",))
case("ops.MultiScaleRoIAlign", "a feature map missing", lambda d: MultiScaleRoIAlign(["p2", "p9"], 2, 2)(*fpn(d)),
     raises("feature maps", exc=KeyError))
case("ops.MultiScaleRoIAlign", "no image shapes", lambda d: msra(d, shapes=[]), raises("image_shapes", exc=ValueError))
case("ops.MultiScaleRoIAlign", "featmap_names a string", lambda d: MultiScaleRoIAlign("p2", 2, 2), raises("featmap_names", exc=ValueError))
# boxes without an FPN level (negative or NaN area): zeros, as torchvision gives
NO_LEVEL = [[[50.0, 10, 10, 60], [1, 1, 60, 60]], [[NAN, 0, 10, 10], [0, 0, 30, 30], [20, 20, 10, 30]]]
case("ops.MultiScaleRoIAlign", "boxes with x2 < x1 or NaN",
     lambda d: msra(d, boxes=[torch.tensor(b, device=d) for b in NO_LEVEL]),
     Holds(equal(lambda d: tv_msra(("p2", "p3"), NO_LEVEL), exact=False)))
case("ops.MultiScaleRoIAlign", "boxes with x2 < x1 or NaN, training",
     lambda d: msra(d, boxes=[torch.tensor(b, device=d) for b in NO_LEVEL]) if d == "cpu" else
     (lambda m: m(*fpn(d, boxes_=[torch.tensor(b, device=d) for b in NO_LEVEL])))(MultiScaleRoIAlign(["p2", "p3"], 2, 2).train()),
     Holds(equal(lambda d: tv_msra(("p2", "p3"), NO_LEVEL), exact=False)))
case("ops.MultiScaleRoIAlign", "inf box", lambda d: msra(d, boxes=[torch.tensor([[0.0, 0, INF, 10], [1, 1, 60, 60]], device=d)]),
     Holds(lambda r, d: (torch.isfinite(r).all() and (r[0] == 0).all()) or fail(str(r))))


_huge_finite_rows(("cuda",))

# --- running the table --------------------------------------------------------------------------

for _c in CASES:
    _c.id = f"{_c.op}: {_c.name}"
_ids = [c.id for c in CASES]
assert len(_ids) == len(set(_ids)), sorted(i for i in _ids if _ids.count(i) > 1)
BY_ID: Dict[str, Case] = {c.id: c for c in CASES}
CHILD_TIMEOUT_S = 300


def outcome_of(c: Case, device: str) -> dict:
    """Runs one row here and says what happened (JSON-able)."""
    try:
        result = c.call(device)
        if device == "cuda":
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - what the op raised is the outcome
        return {"raised": [k.__name__ for k in type(e).__mro__], "message": str(e)}
    if isinstance(c.expect, Holds):
        try:
            c.expect.check(result, device)
        except Exception as e:  # noqa: BLE001
            return {"returned": True, "check": "".join(traceback.format_exception_only(type(e), e))[-2000:]}
        return {"returned": True, "check": "ok"}
    return {"returned": True, "check": "ok"}


def child_main(device: str) -> None:
    """The child process: every row of `device` (but DeviceAssert rows), one JSON line before
    and after each."""
    torch.manual_seed(0)
    for c in CASES:
        if device not in c.devices or isinstance(c.expect, DeviceAssert):
            continue
        print(json.dumps({"start": c.id}), flush=True)
        print(json.dumps({"id": c.id, **outcome_of(c, device)}), flush=True)


_RESULTS: Dict[str, Tuple[Dict[str, dict], str]] = {}


def results_for(device: str) -> Tuple[Dict[str, dict], str]:
    """Each row's outcome on `device`, from one child process (run once per session), and the
    child's end: "" when it finished, else what happened."""
    if device not in _RESULTS:
        code = f"from tests.test_bad_inputs import child_main; child_main({device!r})"
        out, end = "", ""
        try:
            done = subprocess.run(
                [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S
            )
            out = done.stdout
            if done.returncode != 0:
                end = f"the child process ended with {done.returncode}: {done.stderr[-3000:]}"
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            end = f"the child process hung (no end within {CHILD_TIMEOUT_S} s)"
        results, started = {}, None
        for line in out.splitlines():
            if not line.startswith("{"):
                continue
            rec = json.loads(line)
            if "start" in rec:
                started = rec["start"]
            else:
                results[rec["id"]] = rec
        if end and started is not None and started not in results:
            results[started] = {"crashed": end}
        _RESULTS[device] = (results, end)
    return _RESULTS[device]


def _params():
    for c in CASES:
        for dev in c.devices:
            marks = [pytest.mark.cuda] if dev == "cuda" else []
            yield pytest.param(dev, c.id, marks=marks, id=f"{c.id} [{dev}]")


@pytest.mark.parametrize("device,case_id", list(_params()))
def test_bad_input(device, case_id):
    c = BY_ID[case_id]
    words = []
    if isinstance(c.expect, DeviceAssert):
        code = (
            "import torch\n"
            "from tests.test_bad_inputs import BY_ID\n"
            f"BY_ID[{case_id!r}].call('cuda')\n"
            "torch.cuda.synchronize()\n"
        )
        out = assert_fails_device_assert(code)
        for word in (OP_NAMES[c.op],) + c.expect.words:
            assert word in out, (word, out[-3000:])
        return
    results, end = results_for(device)
    assert case_id in results, f"no outcome: {end or 'the row did not run'}"
    rec = results[case_id]
    assert "crashed" not in rec, f"crashed or hung in this row: {rec['crashed']}"
    if isinstance(c.expect, Holds):
        assert "raised" not in rec, f"raised {rec['raised'][0]}: {rec['message'][:2000]}"
        assert rec["check"] == "ok", rec["check"]
        return
    exc = c.expect.exc if isinstance(c.expect.exc, tuple) else (c.expect.exc,)
    assert "raised" in rec, "returned instead of raising"
    assert any(k.__name__ in rec["raised"] for k in exc), f"raised {rec['raised'][0]}, not {exc}: {rec['message'][:2000]}"
    words = [OP_NAMES[c.op] if c.expect.op_name is None else c.expect.op_name, *c.expect.words]
    first_line = rec["message"]
    for word in words:
        assert word in first_line, f"{word!r} not in the message: {first_line[:2000]}"


@pytest.mark.parametrize("op", registered_ops() + WRAPPERS)
def test_every_op_has_rows(op):
    # coverage derives from the registry: an op registered without rows fails here
    assert op in OP_NAMES, f"{op} has no message name in OP_NAMES and no rows in the table"
    rows = [c for c in CASES if c.op == op]
    assert rows, f"{op} has no rows in the bad-input table"
    names = " ".join(c.name for c in rows)
    if op in TENSOR_ARGS and op != "_to_channels_last":
        assert "rank" in names and "on meta" in names and "int32" in names, f"{op}: rank, dtype or device rows missing"
