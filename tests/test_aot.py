"""libdetops_aot.so, the C ABI, called through ctypes exactly as a host framework calls it (e.g.
MindSpore's ops.Custom(..., func_type="aot")): raw pointers, ranks, shapes and dtype names.

Loading the library registers the detops ops, which this process already has from detops._C, so
the calls run in a child process that imports only torch and ctypes; this process prepares the
inputs and compares the outputs with detops.ops.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import detops
from detops import jit

pytestmark = pytest.mark.slow

CHILD = textwrap.dedent(
    r"""
    import ctypes, sys
    import torch

    lib = ctypes.CDLL(sys.argv[1])
    lib.DetopsAotLastError.restype = ctypes.c_char_p
    SIG = [ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int),
           ctypes.POINTER(ctypes.POINTER(ctypes.c_int64)), ctypes.POINTER(ctypes.c_char_p),
           ctypes.c_void_p, ctypes.c_void_p]
    for name in ("DetopsNms", "DetopsRoIAlignForward", "DetopsRoIAlignBackward", "DetopsRoIPoolForward"):
        getattr(lib, name).argtypes = SIG
        getattr(lib, name).restype = ctypes.c_int
    NAMES = {torch.float32: b"float32", torch.float16: b"float16", torch.float64: b"float64",
             torch.bfloat16: b"bfloat16", torch.int32: b"int32", torch.int64: b"int64"}

    def call(fn, tensors, stream=None, dtypes=None, shapes=None, nparam=None):
        n = len(tensors)
        shapes = shapes or [list(t.shape) for t in tensors]
        shape_arrays = [(ctypes.c_int64 * max(len(s), 1))(*s) for s in shapes]
        params = (ctypes.c_void_p * n)(*[t.data_ptr() for t in tensors])
        ndims = (ctypes.c_int * n)(*[len(s) for s in shapes])
        shape_ptrs = (ctypes.POINTER(ctypes.c_int64) * n)(
            *[ctypes.cast(a, ctypes.POINTER(ctypes.c_int64)) for a in shape_arrays])
        names = (ctypes.c_char_p * n)(*(dtypes or [NAMES[t.dtype] for t in tensors]))
        code = getattr(lib, fn)(n if nparam is None else nparam, params, ndims, shape_ptrs, names, stream, None)
        return code, lib.DetopsAotLastError().decode()

    cases = torch.load(sys.argv[2])
    device = sys.argv[4]
    results = {}
    if device == "cuda":
        side = torch.cuda.Stream()
        stream = ctypes.c_void_p(side.cuda_stream)
    else:
        side, stream = None, None
    for key, (fn, tensors, kwargs) in cases.items():
        tensors = [t.to(device) for t in tensors]
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
        code, message = call(fn, tensors, stream=stream, **kwargs)
        if side is not None:
            side.synchronize()
        results[key] = (code, message, [t.cpu() for t in tensors])
    torch.save(results, sys.argv[3])
    """
)


@pytest.fixture(scope="module")
def aot_library(torch_extensions_dir):
    saved = os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ["TORCH_EXTENSIONS_DIR"] = str(torch_extensions_dir)
    try:
        path = detops.aot_library_path()
    finally:
        if saved is None:
            os.environ.pop("TORCH_EXTENSIONS_DIR")
        else:
            os.environ["TORCH_EXTENSIONS_DIR"] = saved
    assert os.path.isfile(path)
    return path


def _cases(device):
    g = torch.Generator().manual_seed(0)
    n = 40
    xy = torch.rand(n, 2, generator=g) * 50
    boxes = torch.cat([xy, xy + 5 + torch.rand(n, 2, generator=g) * 20], 1)
    scores = torch.rand(n, generator=g)
    thr = torch.tensor([0.4])
    feats = torch.randn(2, 3, 16, 20, generator=g)
    k = 6
    b = torch.randint(0, 2, (k, 1), generator=g).float()
    p = torch.rand(k, 2, generator=g) * 40
    rois = torch.cat([b, p, p + 4 + torch.rand(k, 2, generator=g) * 30], 1)
    align_attrs = torch.tensor([0.5, 2.0, 1.0])
    grad = torch.randn(k, 3, 4, 5, generator=g)
    keep, count = torch.full((n,), 99, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    nms = ("DetopsNms", [boxes, scores, thr, keep, count], {})
    cases = {
        "nms": nms,
        "nms_f64": ("DetopsNms", [boxes.double(), scores.double(), thr, keep.clone(), count.clone()], {}),
        "nms_empty": ("DetopsNms", [torch.zeros(0, 4), torch.zeros(0), thr, torch.zeros(0, dtype=torch.int64), count.clone()], {}),
        "align": ("DetopsRoIAlignForward", [feats, rois, align_attrs, torch.zeros(k, 3, 4, 5)], {}),
        "align_legacy": ("DetopsRoIAlignForward", [feats, rois, torch.tensor([0.5, 0.0, 0.0]), torch.zeros(k, 3, 3, 3)], {}),
        "align_backward": ("DetopsRoIAlignBackward", [grad, rois, align_attrs, torch.full((2, 3, 16, 20), 7.0)], {}),
        "pool": ("DetopsRoIPoolForward", [feats, rois, torch.tensor([0.5]), torch.zeros(k, 3, 4, 5), torch.zeros(k, 3, 4, 5, dtype=torch.int32)], {}),
        "pool_no_argmax": ("DetopsRoIPoolForward", [feats, rois, torch.tensor([0.5]), torch.zeros(k, 3, 2, 2)], {}),
        # Errors: each must return non-zero and leave the outputs untouched.
        "bad_nparam": ("DetopsNms", [boxes, scores, thr, keep.clone(), count.clone()], {"nparam": 4}),
        "bad_dtype": ("DetopsNms", [boxes, scores, thr, keep.clone(), count.clone()],
                      {"dtypes": [b"float32", b"float32", b"float32", b"complex64", b"int64"]}),
        "mismatched_keep": ("DetopsNms", [boxes, scores, thr, keep.clone(), count.clone()],
                            {"shapes": [[n, 4], [n], [1], [n + 5], [1]]}),
        "mismatched_scores": ("DetopsNms", [boxes, scores, thr, keep.clone(), count.clone()],
                              {"shapes": [[n, 4], [n - 1], [1], [n], [1]]}),
        "wrong_output_dtype": ("DetopsRoIAlignForward", [feats, rois, align_attrs, torch.zeros(k, 3, 4, 5, dtype=torch.float64)], {}),
        "wrong_output_channels": ("DetopsRoIAlignForward", [feats, rois, align_attrs, torch.full((k, 2, 4, 5), 7.0)], {}),
        "rois_of_4": ("DetopsRoIAlignForward", [feats, rois[:, 1:].contiguous(), align_attrs, torch.full((k, 3, 4, 5), 7.0)], {}),
    }
    if device == "cpu":
        # The op rejects it on CPU; CUDA flags it with a device-side assertion instead.
        cases["bad_batch_index"] = (
            "DetopsRoIPoolForward",
            [feats, torch.tensor([[5.0, 0, 0, 4, 4]]), torch.tensor([1.0]), torch.full((1, 3, 2, 2), 7.0)],
            {},
        )
    return cases


def _run(aot_library, tmp_path, device):
    cases = _cases(device)
    torch.save(cases, tmp_path / "cases.pt")
    done = subprocess.run(
        [sys.executable, "-c", CHILD, aot_library, str(tmp_path / "cases.pt"), str(tmp_path / "out.pt"), device],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return cases, torch.load(tmp_path / "out.pt")


def _check(cases, results):
    def ok(key):
        code, message, tensors = results[key]
        assert code == 0, (key, message)
        return tensors

    for key in ("nms", "nms_f64"):
        boxes, scores, thr, keep, count = ok(key)
        want = detops.ops.nms(boxes, scores, float(thr))
        assert int(count) == want.numel()
        assert torch.equal(keep[: want.numel()], want)
        assert (keep[want.numel():] == -1).all()
    assert int(ok("nms_empty")[4]) == 0

    feats, rois, attrs, out = ok("align")
    assert torch.allclose(out, detops.ops.roi_align(feats, rois, (4, 5), 0.5, 2, True), atol=1e-5)
    feats, rois, attrs, out = ok("align_legacy")
    assert torch.allclose(out, detops.ops.roi_align(feats, rois, 3, 0.5, 0, False), atol=1e-5)
    grad, rois, attrs, grad_input = ok("align_backward")
    want = torch.ops.detops._roi_align_backward(grad, rois, 0.5, 4, 5, 2, 3, 16, 20, 2, True)
    assert torch.allclose(grad_input, want, atol=1e-4)
    feats, rois, attrs, out, argmax = ok("pool")
    want_out, want_arg = torch.ops.detops.roi_pool(feats, rois, 0.5, 4, 5)
    assert torch.equal(out, detops.ops.roi_pool(feats, rois, (4, 5), 0.5))
    assert torch.equal(out, want_out) and torch.equal(argmax, want_arg)
    assert torch.equal(ok("pool_no_argmax")[3], detops.ops.roi_pool(feats, rois, 2, 0.5))

    expected_codes = {
        "bad_nparam": 1,
        "bad_dtype": 3,
        "mismatched_keep": 4,
        "mismatched_scores": 4,
        "wrong_output_dtype": 3,
        "wrong_output_channels": 4,
        "rois_of_4": 4,
        "bad_batch_index": 6,
    }
    for key, want_code in expected_codes.items():
        if key not in results:
            continue
        code, message, tensors = results[key]
        assert code == want_code, (key, code, message)
        assert message, key
        for before, after in zip(cases[key][1][3:], tensors[3:]):
            assert torch.equal(before, after), f"{key}: an output was written"
    assert "complex64" in results["bad_dtype"][1]


def test_c_abi_through_ctypes_cpu(aot_library, tmp_path):
    _check(*_run(aot_library, tmp_path, "cpu"))


@pytest.mark.cuda
def test_c_abi_through_ctypes_cuda_stream(aot_library, tmp_path):
    _check(*_run(aot_library, tmp_path, "cuda"))


def test_aot_library_path_honours_the_environment(monkeypatch, tmp_path):
    lib = tmp_path / "libdetops_aot.so"
    lib.write_bytes(b"")
    monkeypatch.setenv("DETOPS_AOT_LIBRARY", str(lib))
    assert detops.aot_library_path() == str(lib)
    monkeypatch.setenv("DETOPS_AOT_LIBRARY", str(tmp_path / "missing.so"))
    with pytest.raises(FileNotFoundError):
        detops.aot_library_path()
    monkeypatch.delenv("DETOPS_AOT_LIBRARY")
    assert jit.aot_library_path(build=False).endswith(".so")
