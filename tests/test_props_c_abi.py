"""Property-based tests of the C ABI (csrc/aot/detops_aot.h) through ctypes: hypothesis draws
parameter lists, valid ones and ones with one defect each, and fully random ones.

  * a valid list returns 0 and the outputs of detops.ops on the same inputs (empty buffers may
    come as NULL pointers);
  * a list with one defect returns that defect's documented code (DetopsAotStatus) with a
    message in DetopsAotLastError(), and leaves every buffer as it was;
  * no list, however random, crashes the process: every call returns a documented code.

Loading libdetops_aot.so registers the detops ops, which this process has from detops._C, so
the calls run in a child process that imports only torch and ctypes (as tests/test_aot.py
does). The child serves calls over a pipe: it allocates each buffer (at least as large as its
declared shape, so that a wrongly accepted shape could not read past it), calls the entry and
sends back every buffer. A crash or a hang of the child fails the example that caused it.
"""
from __future__ import annotations

import math
import os
import pickle
import select
import struct
import subprocess
import sys
import textwrap
from dataclasses import dataclass, replace
from typing import List, Optional

import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

import detops  # noqa: F401  (loads the ops)
from tests.conftest import DEVICES
from tests.test_aot import aot_library  # noqa: F401  (the fixture: the library, built once per session)

OK, BAD_PARAM_COUNT, BAD_POINTER, BAD_DTYPE, BAD_SHAPE, BAD_DEVICE, OP_ERROR, INTERNAL = range(8)
ELEMENT = {"float32": 4, "float16": 2, "float64": 8, "bfloat16": 2, "int32": 4, "int64": 8}
TORCH_DTYPE = {
    "float32": torch.float32, "float16": torch.float16, "float64": torch.float64,
    "bfloat16": torch.bfloat16, "int32": torch.int32, "int64": torch.int64,
}
FLOATS = ["float32", "float64", "float16", "bfloat16"]
# The largest buffer the child allocates for a declared shape (larger declared shapes are
# rejected before any read, or the call is a bug that the allocation of the real data shows).
MAX_ALLOC = 1 << 24
CALL_TIMEOUT_S = 60

CHILD = textwrap.dedent(
    r"""
    import ctypes, pickle, struct, sys
    import torch

    lib = ctypes.CDLL(sys.argv[1])
    lib.DetopsAotLastError.restype = ctypes.c_char_p
    SIG = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
           ctypes.c_void_p, ctypes.c_void_p]
    for name in ("DetopsNms", "DetopsRoIAlignForward", "DetopsRoIAlignBackward", "DetopsRoIPoolForward"):
        getattr(lib, name).argtypes = SIG
        getattr(lib, name).restype = ctypes.c_int
    streams = {}
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    out.write(b"ready\n")
    out.flush()
    while True:
        head = inp.read(8)
        if len(head) < 8:
            break
        req = pickle.loads(inp.read(struct.unpack("<Q", head)[0]))
        dev = req["device"]
        bufs = []
        for p in req["params"]:
            b = torch.zeros(max(p["alloc"], 1), dtype=torch.uint8)
            if p["data"]:
                b[: len(p["data"])] = torch.frombuffer(bytearray(p["data"]), dtype=torch.uint8)
            bufs.append(b.to(dev))
        n = len(req["params"])
        params = (ctypes.c_void_p * n)(*[None if p["null"] else b.data_ptr() for p, b in zip(req["params"], bufs)])
        ndims = (ctypes.c_int * n)(*[p["ndim"] for p in req["params"]])
        keep = []
        shape_ptrs = (ctypes.c_void_p * n)()
        for i, p in enumerate(req["params"]):
            if p["shape"] is not None:
                a = (ctypes.c_int64 * max(len(p["shape"]), 1))(*p["shape"])
                keep.append(a)
                shape_ptrs[i] = ctypes.cast(a, ctypes.c_void_p)
        names = (ctypes.c_char_p * n)(*[p["dtype"] for p in req["params"]])
        arrays = {"params": params, "ndims": ndims, "shapes": shape_ptrs, "dtypes": names}
        args = [None if k in req["null_arrays"] else ctypes.cast(arrays[k], ctypes.c_void_p)
                for k in ("params", "ndims", "shapes", "dtypes")]
        stream = None
        if dev == "cuda":
            side = streams.setdefault(dev, torch.cuda.Stream())
            side.wait_stream(torch.cuda.current_stream())
            stream = ctypes.c_void_p(side.cuda_stream)
        code = getattr(lib, req["fn"])(req["nparam"], *args, stream, ctypes.c_void_p(req["extra"]))
        if dev == "cuda":
            torch.cuda.synchronize()
        message = lib.DetopsAotLastError()
        reply = {"code": code, "message": message.decode(errors="replace") if message is not None else None,
                 "buffers": [b.cpu().numpy().tobytes() for b in bufs]}
        data = pickle.dumps(reply)
        out.write(struct.pack("<Q", len(data)) + data)
        out.flush()
    """
)


class AbiChild:
    """The child process that makes the C ABI calls; restarted after a crash."""

    def __init__(self, library):
        self.library = library
        self.proc = None

    def start(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, self.library], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        line = self._read(8 * CALL_TIMEOUT_S, line=True)
        assert line == b"ready\n", f"the C ABI child did not start: {self._stderr()}"

    def _stderr(self):
        try:
            self.proc.kill()
            return self.proc.communicate(timeout=10)[1].decode(errors="replace")[-3000:]
        except Exception:  # noqa: BLE001
            return ""

    def _read(self, timeout, line=False, n=0):
        fd = self.proc.stdout
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:
            return None
        return fd.readline() if line else fd.read(n)

    def call(self, request):
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        data = pickle.dumps(request)
        self.proc.stdin.write(struct.pack("<Q", len(data)) + data)
        self.proc.stdin.flush()
        head = self._read(CALL_TIMEOUT_S, n=8)
        if not head or len(head) < 8:
            what = "hung" if head is None else "crashed"
            err = self._stderr()
            self.proc = None
            raise AssertionError(f"the C ABI call {what} the process ({request['fn']}): {err}")
        return pickle.loads(self.proc.stdout.read(struct.unpack("<Q", head)[0]))

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def abi(aot_library):  # noqa: F811
    child = AbiChild(aot_library)
    yield child
    child.close()


# --- parameter lists ----------------------------------------------------------------------------


@dataclass
class Param:
    tensor: torch.Tensor            # the buffer's values (contiguous, CPU)
    dtype: Optional[bytes]          # the dtype name passed (None: a NULL name)
    shape: Optional[List[int]]      # the shape passed (None: a NULL shape pointer)
    ndim: int                       # the rank passed
    null: bool = False              # a NULL data pointer


def param(t: torch.Tensor, null_if_empty=False) -> Param:
    name = [k for k, v in TORCH_DTYPE.items() if v == t.dtype][0]
    return Param(t.contiguous(), name.encode(), list(t.shape), t.dim(), null_if_empty and t.numel() == 0)


@dataclass
class Call:
    fn: str
    params: List[Param]
    nparam: int
    outputs: List[int]              # indices of the output parameters
    null_arrays: tuple = ()
    extra: int = 0

    def request(self, device):
        ps = []
        for p in self.params:
            data = p.tensor.view(torch.uint8).numpy().tobytes() if p.tensor.numel() else b""
            declared = 0
            if p.shape is not None and p.dtype is not None and all(s >= 0 for s in p.shape):
                item = ELEMENT.get(p.dtype.decode(errors="replace"), 8)
                declared = math.prod(p.shape[: max(p.ndim, 0)]) * item if p.ndim >= 0 else 0
            alloc = max(len(data), declared if declared <= MAX_ALLOC else 0)
            ps.append({"data": data, "alloc": alloc, "ndim": p.ndim, "shape": p.shape, "dtype": p.dtype, "null": p.null})
        return {"fn": self.fn, "nparam": self.nparam, "params": ps, "null_arrays": self.null_arrays,
                "extra": self.extra, "device": device}


def buffers_of(call: Call, reply):
    """The buffers after the call, as tensors of the parameters' real dtypes and shapes."""
    out = []
    for p, raw in zip(call.params, reply["buffers"]):
        n = p.tensor.numel() * p.tensor.element_size()
        t = torch.frombuffer(bytearray(raw[:n]) or bytearray(1), dtype=torch.uint8)[:n]
        out.append(t.view(p.tensor.dtype).reshape(p.tensor.shape) if n else p.tensor.clone())
    return out


def same_bits(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.numel() else a.shape == b.shape


# --- valid parameter lists ----------------------------------------------------------------------


def fill(shape, dtype, value):
    return torch.full(shape, value, dtype=dtype)


coords = st.floats(-8, 40, allow_nan=False, width=32)


@st.composite
def nms_calls(draw, null_if_empty=True):
    dtype = TORCH_DTYPE[draw(st.sampled_from(FLOATS))]
    n = draw(st.integers(0, 24))
    xy = draw(st.lists(st.tuples(coords, coords), min_size=n, max_size=n))
    wh = draw(st.lists(st.tuples(st.floats(0, 30, width=32), st.floats(0, 30, width=32)), min_size=n, max_size=n))
    boxes = torch.tensor([[x, y, x + w, y + h] for (x, y), (w, h) in zip(xy, wh)], dtype=torch.float64).reshape(n, 4)
    scores = torch.tensor(draw(st.lists(st.sampled_from([0.25, 0.5, 0.75]) | st.floats(0, 1), min_size=n, max_size=n)),
                          dtype=torch.float64)
    thr = torch.tensor([draw(st.floats(0, 1, width=32))], dtype=torch.float32)
    ps = [param(boxes.to(dtype), null_if_empty), param(scores.to(dtype), null_if_empty), param(thr),
          param(fill((n,), torch.int64, 99), null_if_empty), param(fill((1,), torch.int64, 99))]
    return Call("DetopsNms", ps, 5, [3, 4])


@st.composite
def roi_shapes(draw):
    return dict(
        dtype=TORCH_DTYPE[draw(st.sampled_from(FLOATS))], b=draw(st.integers(1, 3)), c=draw(st.integers(0, 3)),
        h=draw(st.integers(0, 9)), w=draw(st.integers(0, 9)), k=draw(st.integers(0, 6)),
        ph=draw(st.integers(1, 4)), pw=draw(st.integers(1, 4)),
        scale=draw(st.sampled_from([0.25, 0.5, 1.0, 2.0])),
    )


def draw_rois(draw, s):
    rows = []
    for _ in range(s["k"]):
        x1, y1, x2, y2 = (draw(coords) / s["scale"] for _ in range(4))
        rows.append([float(draw(st.integers(0, s["b"] - 1))), x1, y1, x2, y2])
    return torch.tensor(rows, dtype=torch.float64).reshape(s["k"], 5).to(s["dtype"])


def values(shape, dtype, draw):
    seed = draw(st.integers(0, 2**31 - 1))
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


@st.composite
def roi_align_forward_calls(draw, null_if_empty=True):
    s = draw(roi_shapes())
    attrs = torch.tensor([s["scale"], draw(st.integers(-3, 3)), draw(st.sampled_from([0.0, 1.0]))], dtype=torch.float32)
    ps = [param(values((s["b"], s["c"], s["h"], s["w"]), s["dtype"], draw), null_if_empty),
          param(draw_rois(draw, s), null_if_empty), param(attrs),
          param(fill((s["k"], s["c"], s["ph"], s["pw"]), s["dtype"], 7.0), null_if_empty)]
    return Call("DetopsRoIAlignForward", ps, 4, [3])


@st.composite
def roi_align_backward_calls(draw, null_if_empty=True):
    s = draw(roi_shapes())
    attrs = torch.tensor([s["scale"], draw(st.integers(-3, 3)), draw(st.sampled_from([0.0, 1.0]))], dtype=torch.float32)
    ps = [param(values((s["k"], s["c"], s["ph"], s["pw"]), s["dtype"], draw), null_if_empty),
          param(draw_rois(draw, s), null_if_empty), param(attrs),
          param(fill((s["b"], s["c"], s["h"], s["w"]), s["dtype"], 7.0), null_if_empty)]
    return Call("DetopsRoIAlignBackward", ps, 4, [3])


@st.composite
def roi_pool_forward_calls(draw, null_if_empty=True):
    s = draw(roi_shapes())
    out_shape = (s["k"], s["c"], s["ph"], s["pw"])
    ps = [param(values((s["b"], s["c"], s["h"], s["w"]), s["dtype"], draw), null_if_empty),
          param(draw_rois(draw, s), null_if_empty), param(torch.tensor([s["scale"]], dtype=torch.float32)),
          param(fill(out_shape, s["dtype"], 7.0), null_if_empty)]
    if draw(st.booleans()):
        ps.append(param(fill(out_shape, torch.int32, 99), null_if_empty))
        return Call("DetopsRoIPoolForward", ps, 5, [3, 4])
    return Call("DetopsRoIPoolForward", ps, 4, [3])


VALID = {
    "DetopsNms": nms_calls,
    "DetopsRoIAlignForward": roi_align_forward_calls,
    "DetopsRoIAlignBackward": roi_align_backward_calls,
    "DetopsRoIPoolForward": roi_pool_forward_calls,
}
PARAM_COUNTS = {"DetopsNms": (5, 5), "DetopsRoIAlignForward": (4, 4), "DetopsRoIAlignBackward": (4, 4), "DetopsRoIPoolForward": (4, 5)}


def expected_outputs(call: Call, device):
    """What detops.ops gives for a valid call's outputs (CPU tensors)."""
    t = [p.tensor.to(device) for p in call.params]
    D = torch.ops.detops
    if call.fn == "DetopsNms":
        n = t[0].size(0)
        if n == 0:
            return [t[3].cpu(), torch.zeros(1, dtype=torch.int64)]
        kept = detops.ops.nms(t[0], t[1], float(t[2].item())).cpu()
        keep = torch.full((n,), -1, dtype=torch.int64)
        keep[: kept.numel()] = kept
        return [keep, torch.tensor([kept.numel()])]
    a = t[2].cpu().tolist()
    if call.fn == "DetopsRoIAlignForward":
        ph, pw = t[3].shape[2:]
        return [D.roi_align(t[0], t[1], a[0], ph, pw, int(a[1]), a[2] == 1.0).cpu()]
    if call.fn == "DetopsRoIAlignBackward":
        _, _, ph, pw = t[0].shape
        b, c, h, w = t[3].shape
        return [D._roi_align_backward(t[0], t[1], a[0], ph, pw, b, c, h, w, int(a[1]), a[2] == 1.0).cpu()]
    ph, pw = t[3].shape[2:]
    if len(t) == 5:
        return [x.cpu() for x in D.roi_pool(t[0], t[1], a[0], ph, pw)]
    return [D._roi_pool_values(t[0], t[1], a[0], ph, pw).cpu()]


def check_valid(abi, call, device):
    reply = abi.call(call.request(device))
    assert reply["code"] == OK, reply["message"]
    after = buffers_of(call, reply)
    for i, p in enumerate(call.params):
        if i not in call.outputs:
            assert same_bits(after[i], p.tensor), f"input {i} was written"
    want = expected_outputs(call, device)
    for i, w in zip(call.outputs, want):
        got = after[i]
        if device == "cpu" or w.dtype in (torch.int32, torch.int64):
            assert same_bits(got, w), (i, got, w)
        else:
            torch.testing.assert_close(got, w)


# --- one defect per list ------------------------------------------------------------------------

# (param, dim) pairs that must agree with another parameter's size or with a fixed size
TIED = {
    "DetopsNms": [(0, 0), (0, 1), (1, 0), (2, 0), (3, 0), (4, 0)],
    "DetopsRoIAlignForward": [(0, 1), (1, 0), (1, 1), (2, 0), (3, 0), (3, 1)],
    "DetopsRoIAlignBackward": [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (3, 1)],
    "DetopsRoIPoolForward": [(0, 1), (1, 0), (1, 1), (2, 0), (3, 0), (3, 1), (4, 0), (4, 1), (4, 2), (4, 3)],
}
DEFECTS = [
    "nparam", "null array", "null dtype name", "unknown dtype name", "wrong dtype", "null data",
    "null shape", "negative size", "wrong rank", "rank outside [0, 8]", "mismatched size", "size overflow",
    "bad attrs", "bad batch index", "zero pooled size",
]
DEFECT_CODE = {
    "nparam": BAD_PARAM_COUNT, "null array": BAD_POINTER, "null dtype name": BAD_POINTER,
    "unknown dtype name": BAD_DTYPE, "wrong dtype": BAD_DTYPE, "null data": BAD_POINTER,
    "null shape": BAD_POINTER, "negative size": BAD_SHAPE, "wrong rank": BAD_SHAPE,
    "rank outside [0, 8]": BAD_SHAPE, "mismatched size": BAD_SHAPE, "size overflow": BAD_SHAPE,
    "bad attrs": OP_ERROR, "bad batch index": OP_ERROR, "zero pooled size": OP_ERROR,
}


def with_defect(draw, call: Call, defect: str, device: str) -> Call:
    ps = [replace(p) for p in call.params]
    pick = lambda candidates: draw(st.sampled_from(candidates))  # noqa: E731
    everyone = list(range(len(ps)))
    if defect == "nparam":
        lo, hi = PARAM_COUNTS[call.fn]
        bad = draw(st.sampled_from([-1, 0, lo - 1, hi + 1, hi + 3, 2**31 - 1]).filter(lambda v: not lo <= v <= hi))
        return replace(call, nparam=bad)
    if defect == "null array":
        return replace(call, null_arrays=(pick(["params", "ndims", "shapes", "dtypes"]),))
    i = pick(everyone)
    p = ps[i]
    if defect == "null dtype name":
        p.dtype = None
    elif defect == "unknown dtype name":
        p.dtype = pick([b"complex64", b"", b"float", b"Float32", b"int8", b"float32 ", b"bool"])
    elif defect == "wrong dtype":
        now = p.dtype.decode()
        p.dtype = pick([n for n in ELEMENT if n != now]).encode()
    elif defect == "null data":
        full = [j for j in everyone if ps[j].tensor.numel() > 0]
        assume(full)
        ps[pick(full)].null = True
    elif defect == "null shape":
        ranked = [j for j in everyone if ps[j].ndim > 0]
        ps[pick(ranked)].shape = None
    elif defect == "negative size":
        d = draw(st.integers(0, p.ndim - 1))
        p.shape = list(p.shape)
        p.shape[d] = -draw(st.integers(1, 2**62))
    elif defect == "wrong rank":
        # (rank 0 holds one element: not for an empty buffer passed as NULL)
        r = draw(st.sampled_from([r for r in range(1 if p.null else 0, 6) if r != p.ndim]))
        # more dimensions: sizes of 1 appended; fewer: the last ones merged
        p.shape = list(p.shape) + [1] * (r - p.ndim) if r > p.ndim else (
            list(p.shape[: r - 1]) + [math.prod(p.shape[r - 1:])] if r > 0 else [])
        p.ndim = r
    elif defect == "rank outside [0, 8]":
        p.ndim = pick([-1, -100, 9, 2**31 - 1])
    elif defect == "mismatched size":
        j, d = pick([(j, d) for j, d in TIED[call.fn] if j < len(ps)])
        ps[j].shape = list(ps[j].shape)
        ps[j].shape[d] = ps[j].shape[d] + draw(st.sampled_from([-1, 1, 2, 5]))
        assume(ps[j].shape[d] >= 0)
        ps[j].null = False  # an empty buffer made non-empty needs a pointer (to a large enough buffer)
    elif defect == "size overflow":
        ranked = [j for j in everyone if ps[j].ndim > 0]
        j = pick(ranked)
        ps[j].shape = list(ps[j].shape)
        d = draw(st.integers(0, ps[j].ndim - 1))
        ps[j].shape = [s if k == d else max(s, 1) for k, s in enumerate(ps[j].shape)]
        # bytes past 2^63 whatever the other sizes (made >= 1) and the element size (>= 2)
        ps[j].shape[d] = draw(st.sampled_from([2**62, 2**63 - 1]))
    elif defect == "bad attrs":
        a = ps[2].tensor.clone()
        if call.fn == "DetopsNms":
            a[0] = pick([math.nan, math.inf, -math.inf])
        elif call.fn == "DetopsRoIPoolForward":
            a[0] = pick([math.nan, math.inf, 0.0, -1.0])
        else:
            slot = draw(st.integers(0, 2))
            a[slot] = pick({0: [math.nan, math.inf, 0.0, -0.5], 1: [0.5, -2.5, math.nan, 1e30, -1e30, math.inf],
                            2: [0.5, 2.0, -1.0, math.nan]}[slot])
        ps[2] = replace(ps[2], tensor=a)
    elif defect == "bad batch index":
        assume(call.fn != "DetopsNms" and ps[1].tensor.size(0) > 0 and device == "cpu")
        r = ps[1].tensor.clone()
        b = (ps[0].tensor.size(0) if call.fn != "DetopsRoIAlignBackward" else ps[3].tensor.size(0))
        r[draw(st.integers(0, r.size(0) - 1)), 0] = pick([float(b), -1.0, 0.5, math.nan])
        ps[1] = replace(ps[1], tensor=r)
    elif defect == "zero pooled size":
        assume(call.fn != "DetopsNms")
        out = 0 if call.fn == "DetopsRoIAlignBackward" else 3
        d = draw(st.sampled_from([2, 3]))
        for j in [out] + ([4] if len(ps) == 5 else []):
            shape = list(ps[j].tensor.shape)
            shape[d] = 0
            ps[j] = param(ps[j].tensor.new_empty(shape), True)
    return replace(call, params=ps)


# --- the properties -----------------------------------------------------------------------------

ENTRIES = list(VALID)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", ENTRIES)
def test_valid_parameter_lists_equal_detops_ops(abi, fn, device):
    @given(VALID[fn](null_if_empty=True) | VALID[fn](null_if_empty=False))
    def run(call):
        check_valid(abi, call, device)

    run()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", ENTRIES)
def test_one_defect_gives_its_code_and_touches_nothing(abi, fn, device):
    @given(st.data(), st.sampled_from(DEFECTS))
    def run(data, defect):
        call = with_defect(data.draw, data.draw(VALID[fn]()), defect, device)
        reply = abi.call(call.request(device))
        want = DEFECT_CODE[defect]
        assert reply["code"] == want, (defect, reply["code"], reply["message"])
        assert reply["message"] and fn in reply["message"], reply["message"]
        for i, (p, after) in enumerate(zip(call.params, buffers_of(call, reply))):
            assert same_bits(after, p.tensor), f"{defect}: buffer {i} was written"

    run()


@st.composite
def random_calls(draw):
    """Parameter lists from anything: counts, ranks, sizes (negative included), dtype names,
    NULL pointers; each buffer holds its declared size where that is small."""
    fn = draw(st.sampled_from(ENTRIES))
    n = draw(st.integers(0, 6))
    ps = []
    for _ in range(n):
        ndim = draw(st.integers(-1, 5) | st.sampled_from([9, 2**31 - 1]))
        shape = draw(st.lists(st.integers(-2, 6), min_size=max(min(ndim, 8), 0), max_size=max(min(ndim, 8), 0)))
        name = draw(st.sampled_from(list(ELEMENT) + ["complex64", ""]))
        numel = math.prod(shape) if all(s >= 0 for s in shape) and 0 <= ndim <= 8 else 0
        dtype = TORCH_DTYPE.get(name, torch.float32)
        t = (torch.rand(numel) * 10).to(dtype) if numel else torch.zeros(0, dtype=dtype)
        ps.append(Param(t, name.encode() if draw(st.integers(0, 15)) else None,
                        shape if draw(st.integers(0, 15)) else None, ndim, null=draw(st.integers(0, 7)) == 0))
    nparam = draw(st.just(n) | st.integers(-2, 8).filter(lambda v: v <= n))
    nulls = tuple(k for k in ("params", "ndims", "shapes", "dtypes") if draw(st.integers(0, 19)) == 0)
    return Call(fn, ps, nparam, list(range(n)), nulls)


def test_random_parameter_lists_never_crash(abi):
    @given(random_calls())
    def run(call):
        reply = abi.call(call.request("cpu"))
        assert reply["code"] in range(8), reply["code"]
        if reply["code"] == OK:
            assert call.nparam == len(call.params)
        else:
            assert reply["message"], "no message for a failed call"
            for i, (p, after) in enumerate(zip(call.params, buffers_of(call, reply))):
                assert same_bits(after, p.tensor), f"buffer {i} was written by a failed call"

    run()


# --- regressions: lists that were accepted, or converted with undefined behaviour -------------


def _align_call(fn="DetopsRoIAlignForward", attrs=(1.0, 2.0, 0.0), channels=2, batch_index=0.0):
    x = torch.randn(1, channels, 6, 6)
    rois = torch.tensor([[batch_index, 0.0, 0.0, 4.0, 4.0]])
    a = torch.tensor(attrs, dtype=torch.float32)
    if fn == "DetopsRoIAlignForward":
        return Call(fn, [param(x), param(rois), param(a), param(fill((1, channels, 2, 2), torch.float32, 7.0), True)], 4, [3])
    grad = torch.randn(1, channels, 2, 2)
    return Call(fn, [param(grad, True), param(rois), param(a), param(fill(tuple(x.shape), torch.float32, 7.0), True)], 4, [3])


REGRESSIONS = {
    # sampling_ratio went through static_cast<int64_t>(float): undefined for NaN and 1e30
    "sampling_ratio nan": (_align_call(attrs=(1.0, math.nan, 0.0)), OP_ERROR),
    "sampling_ratio 1e30": (_align_call(attrs=(1.0, 1e30, 0.0)), OP_ERROR),
    "sampling_ratio -1e30, backward": (_align_call("DetopsRoIAlignBackward", attrs=(1.0, -1e30, 0.0)), OP_ERROR),
    # truncated to 2, and aligned 0.5 taken as 1
    "sampling_ratio 2.5": (_align_call(attrs=(1.0, 2.5, 0.0)), OP_ERROR),
    "aligned 0.5": (_align_call(attrs=(1.0, 2.0, 0.5)), OP_ERROR),
    # an empty output returned before the batch indices were checked
    "no channels, batch index 3": (_align_call(channels=0, batch_index=3.0), OP_ERROR),
    "no channels, batch index 3, backward": (_align_call("DetopsRoIAlignBackward", channels=0, batch_index=3.0), OP_ERROR),
    # N = 0 returned before the threshold was read
    "nms of no boxes, NaN threshold": (
        Call("DetopsNms", [param(torch.zeros(0, 4), True), param(torch.zeros(0), True),
                           param(torch.tensor([math.nan])), param(torch.zeros(0, dtype=torch.int64), True),
                           param(torch.tensor([5], dtype=torch.int64))], 5, [3, 4]),
        OP_ERROR,
    ),
}


@pytest.mark.parametrize("name", list(REGRESSIONS))
def test_regressions(abi, name):
    call, want = REGRESSIONS[name]
    reply = abi.call(call.request("cpu"))
    assert reply["code"] == want, (reply["code"], reply["message"])
    for i, (p, after) in enumerate(zip(call.params, buffers_of(call, reply))):
        assert same_bits(after, p.tensor), f"buffer {i} was written"
