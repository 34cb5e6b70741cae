"""detops.ops.roi_pool against torchvision.ops.roi_pool and the plain-PyTorch reference."""
import math

import pytest
import torch
import torchvision

import detops
from detops.ops import RoIPool, roi_pool
from detops.reference import roi_pool as ref
from detops.testing import random_rois as bench_rois
from tests.conftest import (
    DEVICES,
    assert_fails_device_assert,
    dense_rois,
    invalid_batch_index_code,
    large_output_case,
    op_python_called,
    with_threads,
)

op = torch.ops.detops.roi_pool
op_bwd = torch.ops.detops._roi_pool_backward
op_values = torch.ops.detops._roi_pool_values  # roi_pool's output without argmax


def bits(t):
    """t's bits as integers of the same size: equal bits, zero signs included."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def random_rois(k, batch, height, width, scale, seed=0, dtype=torch.float32):
    """RoIs in image coordinates: most inside, some partly or wholly outside, tiny, huge,
    inverted, and coordinates on .5 rounding boundaries."""
    g = torch.Generator().manual_seed(seed)
    ih, iw = height / scale, width / scale
    xy = torch.rand(k, 2, generator=g) * torch.tensor([iw, ih]) * 1.2 - torch.tensor([iw, ih]) * 0.1
    wh = torch.rand(k, 2, generator=g) * torch.tensor([iw, ih]) * 0.8
    boxes = torch.cat([xy, xy + wh], 1)
    n = k // 8
    boxes[:n] = torch.tensor([-3 * iw, -3 * ih, -2 * iw, -2 * ih])  # wholly outside
    boxes[n : 2 * n] = torch.tensor([-iw, -ih, 2 * iw, 2 * ih])  # huge
    boxes[2 * n : 3 * n, 2:] = boxes[2 * n : 3 * n, :2] + 0.3  # tiny
    boxes[3 * n : 4 * n] = boxes[3 * n : 4 * n].flip(1)  # inverted
    # halfway cases of the scaled coordinate (round half away from zero)
    boxes[4 * n : 5 * n] = (torch.floor(boxes[4 * n : 5 * n] * scale) + 0.5) / scale
    idx = torch.randint(0, batch, (k, 1), generator=g).float()
    return torch.cat([idx, boxes], 1).to(dtype)


def distinct_input(shape, seed=0, dtype=torch.float32):
    """Values without ties (a random permutation), so every maximum is unique."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    return (torch.randperm(n, generator=g).to(torch.float64) / n - 0.5).view(shape).to(dtype)


CASES = [(0.25, (7, 7)), (0.5, (2, 3)), (1.0, (1, 1)), (1.0, (3, 5)), (0.5, (7, 2))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale,size", CASES)
def test_matches_torchvision_and_reference(dtype, scale, size):
    x = distinct_input((2, 3, 13, 17), dtype=dtype)
    rois = random_rois(40, 2, 13, 17, scale, dtype=dtype)
    out, arg = op(x, rois, scale, *size)
    tv = torchvision.ops.roi_pool(x, rois, size, scale)
    assert torch.equal(out, tv)
    r_out, r_arg = ref.roi_pool(x, rois, scale, *size)
    assert torch.equal(out, r_out)
    assert torch.equal(arg, r_arg)
    assert out.dtype == dtype and arg.dtype == torch.int32
    assert (arg == -1).any() and (arg >= 0).any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reduced_precision_matches_reference(dtype):
    x = distinct_input((2, 4, 11, 9), dtype=torch.float32)
    rois = random_rois(30, 2, 11, 9, 0.5)
    xl, rl = x.to(dtype), rois.to(dtype)
    out, arg = op(xl, rl, 0.5, 3, 4)
    r_out, r_arg = ref.roi_pool(xl, rl, 0.5, 3, 4)
    assert out.dtype == dtype
    assert torch.equal(out, r_out)
    # rounding to the small dtype can create ties: both take the first in row-major order
    assert torch.equal(arg, r_arg)


def test_rounding_halfway_cases():
    # 0.5 * scale boundaries: round half away from zero, including negative coordinates
    x = distinct_input((1, 1, 8, 8), dtype=torch.float64)
    coords = torch.tensor([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.5, 4.5])
    rois = torch.stack(
        [torch.zeros(8), coords, coords.roll(1), coords + 2.0, coords.roll(1) + 3.0], 1
    ).double()
    for scale in (1.0, 0.5):
        out, arg = op(x, rois, scale, 2, 2)
        assert torch.equal(out, torchvision.ops.roi_pool(x, rois, 2, scale))
        assert torch.equal(arg, ref.roi_pool(x, rois, scale, 2, 2)[1])


def test_list_of_boxes_and_module():
    x = distinct_input((3, 2, 10, 10))
    boxes = [torch.tensor([[0.0, 0, 5, 5], [2, 3, 9, 8]]), torch.zeros(0, 4), torch.tensor([[1.0, 1, 4, 9]])]
    out = roi_pool(x, boxes, 3)
    assert torch.equal(out, torchvision.ops.roi_pool(x, boxes, 3))
    m = RoIPool((3, 3), 1.0)
    assert torch.equal(m(x, boxes), out)
    assert repr(m) == "RoIPool(output_size=(3, 3), spatial_scale=1.0)"
    # the image without RoIs gets no gradient
    xg = x.clone().requires_grad_()
    roi_pool(xg, boxes, 3).sum().backward()
    assert xg.grad[1].abs().sum() == 0 and xg.grad[0].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_backward_matches_torchvision(dtype):
    x = distinct_input((2, 3, 12, 14), dtype=dtype)
    rois = random_rois(50, 2, 12, 14, 0.5, seed=1, dtype=dtype)
    g = torch.randn(50, 3, 4, 3, dtype=dtype)
    x1 = x.clone().requires_grad_()
    roi_pool(x1, rois, (4, 3), 0.5).backward(g)
    x2 = x.clone().requires_grad_()
    torchvision.ops.roi_pool(x2, rois, (4, 3), 0.5).backward(g)
    assert torch.equal(x1.grad, x2.grad)
    _, arg = op(x, rois, 0.5, 4, 3)
    assert torch.equal(x1.grad, ref.roi_pool_backward(g, rois, arg, 2, 3, 12, 14))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_backward_reduced_precision(dtype):
    x = distinct_input((2, 3, 9, 9)).to(dtype)
    rois = random_rois(40, 2, 9, 9, 1.0, seed=2).to(dtype)
    g = torch.randn(40, 3, 2, 2).to(dtype)
    _, arg = op(x, rois, 1.0, 2, 2)
    gi = op_bwd(g, rois, arg, 1.0, 2, 2, 2, 3, 9, 9)
    assert gi.dtype == dtype
    assert torch.equal(gi, ref.roi_pool_backward(g, rois, arg, 2, 3, 9, 9))


def test_gradcheck():
    x = distinct_input((2, 2, 7, 8), dtype=torch.float64).requires_grad_()
    rois = random_rois(12, 2, 7, 8, 1.0, seed=3, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda t: roi_pool(t, rois, (3, 2), 1.0), (x,))
    assert torch.autograd.gradcheck(lambda t: op(t, rois, 1.0, 3, 2)[0], (x,))


def test_channels_last_and_non_contiguous():
    x = distinct_input((2, 5, 10, 12))
    rois = random_rois(20, 2, 10, 12, 1.0, seed=4)
    want, want_arg = op(x, rois, 1.0, 3, 3)
    cl = x.to(memory_format=torch.channels_last)
    assert torch.equal(op(cl, rois, 1.0, 3, 3)[0], want)
    assert torch.equal(op(cl, rois, 1.0, 3, 3)[1], want_arg)
    nc = distinct_input((2, 12, 5, 10)).permute(0, 2, 3, 1)  # non-contiguous view
    assert torch.equal(op(nc, rois, 1.0, 3, 3)[0], op(nc.contiguous(), rois, 1.0, 3, 3)[0])
    rois_nc = torch.cat([rois, rois], 1)[:, :5]
    assert not rois_nc.is_contiguous()
    assert torch.equal(op(x, rois_nc, 1.0, 3, 3)[0], want)
    # non-contiguous (expanded) gradient
    xg = cl.clone().requires_grad_()
    op(xg, rois, 1.0, 3, 3)[0].sum().backward()
    x2 = x.clone().requires_grad_()
    torchvision.ops.roi_pool(x2, rois, 3, 1.0).sum().backward()
    assert torch.equal(xg.grad, x2.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("channels", [1, 8, 13])
def test_channel_blocks_layouts_and_threads_agree(dtype, channels):
    """Channel counts with whole and partial blocks, channels_last and NCHW input, and 1 to 3
    threads all give the same outputs, argmax and gradient bits; float32 / float64 equal
    torchvision's."""
    x = distinct_input((3, channels, 11, 9), seed=5).to(dtype)
    rois = random_rois(40, 2, 11, 9, 0.5, seed=6).to(dtype)  # image 2 has no RoIs
    rois[::3, 0] = 0  # images with different RoI counts
    grad = torch.randn(40, channels, 3, 2, generator=torch.Generator().manual_seed(7)).to(dtype)

    def run(t, n):
        threads = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            out, arg = op(t, rois, 0.5, 3, 2)
            gi = op_bwd(grad, rois, arg, 0.5, 3, 2, 3, channels, 11, 9)
        finally:
            torch.set_num_threads(threads)
        return out, arg, gi

    want = run(x, 1)
    for xi, n in ((x, 2), (x, 3), (x.to(memory_format=torch.channels_last), 1), (x.to(memory_format=torch.channels_last), 3)):
        for a, b in zip(run(xi, n), want):
            assert torch.equal(a, b)
    assert want[2][2].abs().max() == 0
    if dtype != torch.float16:
        xt = x.clone().requires_grad_()
        out = torchvision.ops.roi_pool(xt, rois, (3, 2), 0.5)
        out.backward(grad)
        assert torch.equal(want[0], out) and torch.equal(want[2], xt.grad)


def test_ties_signed_zeros_and_nan_match_torchvision():
    """Many equal values, -0 / +0 and NaN: the first maximum in row-major order wins, NaN never
    does, exactly as torchvision's scan."""
    g = torch.Generator().manual_seed(8)
    x = torch.randint(-2, 2, (2, 5, 12, 10), generator=g).float()
    x[x == 0] = torch.where(torch.rand(int((x == 0).sum()), generator=g) < 0.5, -0.0, 0.0)
    x[torch.rand(x.shape, generator=g) < 0.1] = float("nan")
    x[:, :, :3, :3] = float("nan")  # bins that only hold NaN
    rois = random_rois(30, 2, 12, 10, 1.0, seed=9)
    out, arg = op(x, rois, 1.0, 4, 3)
    want = torchvision.ops.roi_pool(x, rois, (4, 3), 1.0)
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))  # bits, zero signs included
    fb = torch.ops.torchvision.roi_pool(x, rois, 1.0, 4, 3)[1]
    assert torch.equal(arg, fb.int())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "strided"])
def test_values_op_matches_roi_pool(dtype, layout):
    """_roi_pool_values (the output without argmax) gives roi_pool's output bits: ties, -0 / +0,
    NaN, -inf and -FLT_MAX, bins of NaN only, empty bins and RoIs off the map, 1 and 3 threads."""
    x = tie_input((2, 11, 12, 10), seed=20).to(dtype)
    x[:, :, :3, :3] = float("nan")
    x = {"contiguous": x, "channels_last": x.contiguous(memory_format=torch.channels_last),
         "strided": x.transpose(2, 3).contiguous().transpose(2, 3)}[layout]
    rois = random_rois(30, 2, 12, 10, 1.0, seed=21).to(dtype)
    for size in [(4, 3), (1, 1), (7, 7)]:
        want = op(x, rois, 1.0, *size)[0]
        for n in (1, 3):
            got = with_threads(n, lambda: op_values(x, rois, 1.0, *size))
            assert got.dtype == dtype and got.shape == want.shape
            assert torch.equal(bits(got), bits(want)), (size, n)
    assert op_values(x, rois[:0], 1.0, 2, 2).shape == (0, 11, 2, 2)


def _ops_dispatched(fn):
    """Names of the detops ops that fn() runs below autograd (a TorchDispatchMode sees them)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    names = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "detops":
                names.append(func.name())
            return func(*args, **(kwargs or {}))

    with Record():
        fn()
    return names


def test_roi_pool_skips_argmax_without_gradient():
    """roi_pool runs the op with argmax only when input needs a gradient: an input that does
    not require grad, or grad mode off, takes _roi_pool_values (no argmax computed or kept)."""
    x = distinct_input((2, 3, 9, 10))
    rois = random_rois(10, 2, 9, 10, 0.5, seed=5)
    want = op(x, rois, 0.5, 3, 2)[0]
    out = []
    assert _ops_dispatched(lambda: out.append(roi_pool(x, rois, (3, 2), 0.5))) == ["detops::_roi_pool_values"]
    xg = x.clone().requires_grad_()
    with torch.no_grad():
        assert _ops_dispatched(lambda: out.append(roi_pool(xg, rois, (3, 2), 0.5))) == ["detops::_roi_pool_values"]
    assert _ops_dispatched(lambda: out.append(roi_pool(xg, rois, (3, 2), 0.5))) == ["detops::roi_pool"]
    assert _ops_dispatched(lambda: out.append(RoIPool((3, 2), 0.5)(x, rois))) == ["detops::_roi_pool_values"]
    for o in out:
        assert torch.equal(bits(o.detach()), bits(want))
    assert not out[0].requires_grad and not out[1].requires_grad and out[2].requires_grad
    g = torch.randn_like(want)
    out[2].backward(g)
    torch.testing.assert_close(xg.grad, ref.roi_pool_backward(g, rois, op(x, rois, 0.5, 3, 2)[1], 2, 3, 9, 10))
    # the values op itself is differentiable the same way (its C++ autograd runs roi_pool)
    xv = x.clone().requires_grad_()
    assert _ops_dispatched(lambda: op_values(xv, rois, 0.5, 3, 2).backward(g)) == [
        "detops::roi_pool", "detops::_roi_pool_backward"]
    assert torch.equal(xv.grad, xg.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 3])
def test_cpu_channels_last_input_gets_channels_last_grad(dtype, threads):
    """A CPU input stored channels_last gets its gradient in that layout, with the NCHW input's
    bits: the backward writes NCHW planes and the autograd copies them once through
    _to_channels_last. An NCHW input, or one that is both layouts at once (one channel), gets
    the backward's own tensor."""
    for channels in (20, 1):
        x = distinct_input((2, channels, 11, 9), seed=3).to(dtype)
        rois = random_rois(30, 2, 11, 9, 0.5, seed=4).to(dtype)
        grad = torch.randn(30, channels, 3, 2, generator=torch.Generator().manual_seed(5)).to(dtype)

        def grad_of(t):
            t = t.detach().requires_grad_()
            ops = with_threads(threads, lambda: _ops_dispatched(lambda: roi_pool(t, rois, (3, 2), 0.5).backward(grad)))
            return t.grad, ops

        want, ops_nchw = grad_of(x)
        got, ops_cl = grad_of(x.to(memory_format=torch.channels_last))
        assert ops_nchw == ["detops::roi_pool", "detops::_roi_pool_backward"]
        assert want.is_contiguous() and got.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(got, want)
        if channels > 1:
            assert ops_cl == ops_nchw + ["detops::_to_channels_last"] and not got.is_contiguous()
        else:
            assert ops_cl == ops_nchw
        # as the op's backward returns it, before a leaf's AccumulateGrad
        xcl = x.to(memory_format=torch.channels_last).requires_grad_()
        (direct,) = torch.autograd.grad(roi_pool(xcl, rois, (3, 2), 0.5), xcl, grad)
        assert direct.is_contiguous(memory_format=torch.channels_last) and torch.equal(direct, want)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("deterministic", [False, True])
def test_cuda_channels_last_input_gets_channels_last_grad(dtype, deterministic):
    """A CUDA input stored channels_last gets its gradient in that layout too, through
    _to_channels_last's tiled transpose after the backward, as the op's backward returns it and
    in a leaf's .grad: equal to the NCHW input's gradient under deterministic algorithms, close
    to it with the atomic backward (whose additions into a pixel come in any order). 40 channels
    and 11x9 pixels leave partial tiles of 32 on both axes; one channel takes no copy."""
    for channels in (40, 1):
        x = distinct_input((2, channels, 11, 9), seed=3).to(dtype=dtype, device="cuda")
        rois = random_rois(30, 2, 11, 9, 0.5, seed=4).to(dtype=dtype, device="cuda")
        grad = torch.randn(30, channels, 3, 2, generator=torch.Generator().manual_seed(5)).to(dtype=dtype, device="cuda")
        prev = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(deterministic)
        try:
            t = x.detach().requires_grad_()
            (want,) = torch.autograd.grad(roi_pool(t, rois, (3, 2), 0.5), t, grad)
            t = x.to(memory_format=torch.channels_last).requires_grad_()
            ops = _ops_dispatched(lambda: roi_pool(t, rois, (3, 2), 0.5).backward(grad))
            (direct,) = torch.autograd.grad(roi_pool(t, rois, (3, 2), 0.5), t, grad)
        finally:
            torch.use_deterministic_algorithms(prev)
        assert want.is_contiguous()
        for got in (t.grad, direct):
            assert got.is_contiguous(memory_format=torch.channels_last)
            if deterministic:
                assert torch.equal(got, want)
            else:
                atol = {2: 1e-2, 4: 1e-5, 8: 1e-12}[dtype.itemsize]
                torch.testing.assert_close(got, want, atol=atol, rtol=0)
        if channels > 1:
            assert not direct.is_contiguous()
            assert ops == ["detops::roi_pool", "detops::_roi_pool_backward", "detops::_to_channels_last"]
        else:
            assert ops == ["detops::roi_pool", "detops::_roi_pool_backward"]


CPU_VECTORS = ["auto", "avx512", "avx2", "sse2", "scalar"]


def tie_input(shape, seed, nan=0.1):
    """Small integers (many ties), -0 and +0, NaN, -inf and -FLT_MAX in random places."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 2, shape, generator=g).float()
    zeros = x == 0
    x[zeros] = torch.where(torch.rand(int(zeros.sum()), generator=g) < 0.5, -0.0, 0.0)
    u = torch.rand(shape, generator=g)
    x[u < nan] = float("nan")
    x[(u >= nan) & (u < nan + 0.02)] = float("-inf")
    x[(u >= nan + 0.02) & (u < nan + 0.04)] = torch.finfo(torch.float32).min
    return x


def strip_rois(batch, height, width, seed):
    """RoIs at scale 1 whose width runs over 1..17 pixels (and the whole map), at every column
    offset modulo 4 and up against both edges of the map."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for w in list(range(1, 18)) + [width]:
        for x1 in sorted({0, 1, 2, 3, max(width - w, 0), max(width - w - 1, 0)}):
            y1 = int(torch.randint(0, height, (1,), generator=g))
            y2 = y1 + int(torch.randint(0, 6, (1,), generator=g))
            b = int(torch.randint(0, batch, (1,), generator=g))
            rows.append([b, x1, y1, x1 + w - 1, y2])
    return torch.tensor(rows, dtype=torch.float32)


def _cpu_vector_results(x, rois, size, scale):
    """Per CPU path: (output, argmax) of roi_pool, and the output of _roi_pool_values (which
    tracks no index in the vector paths)."""
    from detops.ops._utils import cpu_vector

    results = {}
    for name in CPU_VECTORS:
        with cpu_vector(name):
            results[name] = (*op(x, rois, scale, *size), op_values(x, rois, scale, *size))
    return results


@pytest.mark.parametrize("channels", [8, 13, 19, 37])
@pytest.mark.parametrize("width", [1, 3, 4, 5, 9, 23])
def test_cpu_vector_paths_ties_nan_and_widths(channels, width):
    """The float32 vector paths (AVX2 with and without AVX-512VL's masks where the CPU has
    them, SSE2) and the scalar path give torchvision's value bits and argmax, NCHW and
    channels_last, on bin widths 1..17 at every column offset, maps narrower than a vector,
    partial channel blocks, ties, -0 / +0, NaN, -inf and -FLT_MAX in every lane."""
    x = tie_input((2, channels, 7, width), seed=10 + width)
    x[:, :, :2, :2] = float("nan")  # bins that only hold NaN
    rois = strip_rois(2, 7, width, seed=channels)
    for size in [(1, 1), (2, 1), (3, 2), (2, 3), (1, 7)]:
        want = torch.ops.torchvision.roi_pool(x, rois, 1.0, *size)
        for xi in (x, x.contiguous(memory_format=torch.channels_last)):
            for name, (out, arg, values) in _cpu_vector_results(xi, rois, size, 1.0).items():
                assert torch.equal(out.view(torch.int32), want[0].view(torch.int32)), (name, size)
                assert torch.equal(arg, want[1].int()), (name, size)
                assert torch.equal(values.view(torch.int32), want[0].view(torch.int32)), (name, size)


@pytest.mark.parametrize("channels_last", [False, True])
def test_cpu_vector_paths_random_rois_and_threads(channels_last):
    """Clipped, huge, tiny and inverted RoIs, fractional bins, 1 and 3 threads: all paths equal
    torchvision, outputs and gradients."""
    x = tie_input((2, 16, 20, 23), seed=3, nan=0.02)
    x = x.contiguous(memory_format=torch.channels_last) if channels_last else x
    rois = random_rois(60, 2, 20, 23, 0.5, seed=11)
    want = torch.ops.torchvision.roi_pool(x, rois, 0.5, 5, 4)
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            for name, (out, arg, values) in _cpu_vector_results(x, rois, (5, 4), 0.5).items():
                assert torch.equal(out.view(torch.int32), want[0].view(torch.int32)), name
                assert torch.equal(arg, want[1].int()), name
                assert torch.equal(values.view(torch.int32), want[0].view(torch.int32)), name
    finally:
        torch.set_num_threads(threads)


def test_cpu_vector_choice():
    from detops.ops._utils import cpu_vector

    with pytest.raises(RuntimeError, match="'auto', 'sse2', 'scalar', 'avx2' or 'avx512'"):
        with cpu_vector("avx512vl"):
            pass
    with cpu_vector("scalar"):
        with cpu_vector("sse2"):
            assert detops._C._set_cpu_vector("sse2") == "sse2"
            with cpu_vector("avx512"):
                with cpu_vector("avx2"):
                    assert detops._C._set_cpu_vector("avx2") == "avx2"
                assert detops._C._set_cpu_vector("avx512") == "avx512"
        assert detops._C._set_cpu_vector("scalar") == "scalar"
    assert detops._C._set_cpu_vector("auto") == "auto"


@pytest.mark.parametrize("device", DEVICES)
def test_empty(device):
    x = torch.randn(2, 3, 5, 5, device=device, requires_grad=True)
    rois = torch.zeros(0, 5, device=device)
    out, arg = op(x, rois, 1.0, 2, 2)
    assert out.shape == (0, 3, 2, 2) and arg.shape == (0, 3, 2, 2) and arg.dtype == torch.int32
    roi_pool(x, rois, 2).sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))
    # zero-sized feature map: every bin is empty
    z = torch.randn(1, 2, 0, 4, device=device)
    out, arg = op(z, torch.tensor([[0.0, 0, 0, 3, 3]], device=device), 1.0, 2, 2)
    assert torch.equal(out, torch.zeros(1, 2, 2, 2, device=device)) and (arg == -1).all()


def test_opcheck():
    x = distinct_input((2, 3, 9, 10), dtype=torch.float64).requires_grad_()
    rois = random_rois(10, 2, 9, 10, 0.5, seed=5, dtype=torch.float64)
    torch.library.opcheck(op, (x, rois, 0.5, 3, 2))
    torch.library.opcheck(op_values, (x, rois, 0.5, 3, 2))
    torch.library.opcheck(op_values, (x.detach(), rois, 0.5, 3, 2))
    _, arg = op(x.detach(), rois, 0.5, 3, 2)
    g = torch.randn(10, 3, 3, 2, dtype=torch.float64)
    torch.library.opcheck(op_bwd, (g, rois, arg, 0.5, 3, 2, 2, 3, 9, 10))


def test_autograd_is_cpp():
    # The op's autograd is registered in C++ (csrc/autograd): neither the forward of an input
    # that needs a gradient nor its backward runs Python of torch.library or of detops.
    x = distinct_input((2, 3, 9, 10), dtype=torch.float64).requires_grad_()
    rois = random_rois(10, 2, 9, 10, 0.5, seed=5, dtype=torch.float64)
    res = []
    called = op_python_called(lambda: res.extend(op.default(x, rois, 0.5, 3, 2)))
    out, arg = res
    assert not arg.requires_grad
    g = torch.randn_like(out)
    called |= op_python_called(lambda: out.backward(g))
    assert not called, called
    want = ref.roi_pool_backward(g, rois, arg, 2, 3, 9, 10)
    torch.testing.assert_close(x.grad, want, rtol=0, atol=1e-12)


def test_compile_fullgraph():
    x = distinct_input((2, 3, 8, 8))
    rois = random_rois(6, 2, 8, 8, 1.0, seed=6)

    def f(t, r):
        return roi_pool(t, r, (2, 2), 1.0).pow(2).sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    x1 = x.clone().requires_grad_()
    compiled(x1, rois).backward()
    x2 = x.clone().requires_grad_()
    f(x2, rois).backward()
    assert torch.equal(x1.grad, x2.grad)
    # a channels_last input: the traced backward returns its gradient in that layout too
    x3 = x.clone().to(memory_format=torch.channels_last).requires_grad_()
    compiled(x3, rois).backward()
    assert x3.grad.is_contiguous(memory_format=torch.channels_last) and torch.equal(x3.grad, x2.grad)
    with torch.no_grad():  # inference: the values op, through its fake kernel
        assert torch.equal(compiled(x1, rois), f(x2, rois))


def test_autocast_cpu():
    x = distinct_input((1, 2, 8, 8)).bfloat16()
    rois = torch.tensor([[0.0, 0, 0, 7, 7], [0, 2, 2, 5, 6]])  # float32 RoIs, bfloat16 features
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = roi_pool(x, rois, 2)
        out_f, arg = op(x.float(), rois, 1.0, 2, 2)
        out_x, _ = op(x, rois.bfloat16(), 1.0, 2, 2)
    assert out.dtype == torch.bfloat16 and out_x.dtype == torch.bfloat16
    assert out_f.dtype == torch.float32 and arg.dtype == torch.int32
    assert torch.equal(out, op(x.float(), rois, 1.0, 2, 2)[0].bfloat16())
    # backward through the Function and through the op's own autograd registration
    for fn in (lambda t: roi_pool(t, rois, 2), lambda t: op(t, rois, 1.0, 2, 2)[0]):
        xg = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fn(xg)
        y.float().sum().backward()
        assert xg.grad.dtype == torch.bfloat16 and xg.grad.sum() == 16  # 2 RoIs x 2 channels x 4 bins


BAD = [
    (lambda x, r: op(x[0], r, 1.0, 2, 2), "input must be a [B, C, H, W] tensor, got [3, 8, 8]"),
    (lambda x, r: op(x, r[:, :4], 1.0, 2, 2), "rois must be a [K, 5] tensor, got [3, 4]"),
    (lambda x, r: op(x, r[0], 1.0, 2, 2), "rois must be a [K, 5] tensor, got [5]"),
    (lambda x, r: op(x.double(), r, 1.0, 2, 2), "input and rois must have the same dtype"),
    (lambda x, r: op(x.int(), r.int(), 1.0, 2, 2), "input must be a float32, float64"),
    (lambda x, r: op(x, r, 1.0, 0, 2), "pooled_height and pooled_width must be positive"),
    (lambda x, r: op(x, r, 1.0, 2, -1), "pooled_height and pooled_width must be positive"),
    (lambda x, r: op(x, r, 0.0, 2, 2), "spatial_scale must be a finite number > 0"),
    (lambda x, r: op(x, r, -1.0, 2, 2), "spatial_scale must be a finite number > 0"),
    (lambda x, r: op(x, r, float("nan"), 2, 2), "spatial_scale must be a finite number > 0"),
    (lambda x, r: op(x, r, float("inf"), 2, 2), "spatial_scale must be a finite number > 0"),
    (lambda x, r: op(x, r.index_fill(1, torch.tensor([0]), 2.0), 1.0, 2, 2), "rois[:, 0] must hold batch indices, integers in [0, 2)"),
    (lambda x, r: op(x, r.index_fill(1, torch.tensor([0]), -1.0), 1.0, 2, 2), "rois[:, 0] must hold batch indices"),
    (lambda x, r: op(x, r.index_fill(1, torch.tensor([0]), 0.5), 1.0, 2, 2), "rois[:, 0] must hold batch indices"),
    (lambda x, r: op(x, r.index_fill(1, torch.tensor([0]), float("nan")), 1.0, 2, 2), "rois[:, 0] must hold batch indices"),
    (lambda x, r: op(x.to("meta"), r, 1.0, 2, 2), "input and rois must be on the same device"),
]


@pytest.mark.parametrize("values", [False, True])
@pytest.mark.parametrize("fn,msg", BAD)
def test_bad_inputs(fn, msg, values, monkeypatch):
    # values: the same calls through _roi_pool_values (the output without argmax)
    if values:
        monkeypatch.setitem(globals(), "op", lambda *a: (op_values(*a), None))
    x = torch.randn(2, 3, 8, 8)
    r = torch.tensor([[0.0, 0, 0, 4, 4], [1, 1, 1, 6, 6], [0, 2, 2, 3, 3]])
    with pytest.raises((RuntimeError, ValueError)) as e:
        fn(x, r)
    text = str(e.value)
    assert "roi_pool" in text and msg in text, text


BAD_BACKWARD = [
    (lambda g, r, a: op_bwd(g[:, :2], r, a, 1.0, 2, 2, 2, 3, 8, 8), "grad must be a [K, C, PH, PW]"),
    (lambda g, r, a: op_bwd(g, r, a.long(), 1.0, 2, 2, 2, 3, 8, 8), "argmax must be an int32 tensor"),
    (lambda g, r, a: op_bwd(g, r, a[:2], 1.0, 2, 2, 2, 3, 8, 8), "argmax must be a [K, C, PH, PW]"),
    (lambda g, r, a: op_bwd(g, r[:, :4], a, 1.0, 2, 2, 2, 3, 8, 8), "rois must be a [K, 5] tensor"),
    (lambda g, r, a: op_bwd(g.double(), r, a, 1.0, 2, 2, 2, 3, 8, 8), "grad and rois must have the same dtype"),
    (lambda g, r, a: op_bwd(g, r, a + 100, 1.0, 2, 2, 2, 3, 8, 8), "argmax must hold -1 or indices in [0, H * W = 64)"),
    (lambda g, r, a: op_bwd(g, r, a, 1.0, 2, 2, 1, 3, 8, 8), "rois[:, 0] must hold batch indices, integers in [0, 1)"),
    (lambda g, r, a: op_bwd(g, r, a.to("meta"), 1.0, 2, 2, 2, 3, 8, 8), "grad and argmax must be on the same device"),
]


@pytest.mark.parametrize("fn,msg", BAD_BACKWARD)
def test_bad_backward_inputs(fn, msg):
    x = torch.randn(2, 3, 8, 8)
    r = torch.tensor([[0.0, 0, 0, 4, 4], [1, 1, 1, 6, 6], [0, 2, 2, 3, 3]])
    _, a = op(x, r, 1.0, 2, 2)
    g = torch.randn(3, 3, 2, 2)
    with pytest.raises(RuntimeError) as e:
        fn(g, r, a)
    assert "roi_pool" in str(e.value) and msg in str(e.value), str(e.value)


def test_bad_python_arguments():
    x = torch.randn(1, 1, 4, 4)
    with pytest.raises(ValueError, match="roi_pool: output_size"):
        roi_pool(x, torch.zeros(1, 5), "a")
    with pytest.raises(ValueError, match=r"roi_pool: boxes\[0\]"):
        roi_pool(x, [torch.zeros(2, 5)], 2)


@pytest.mark.parametrize("threads", [1, 3])
def test_cpu_channels_last_rois_in_centre_bands(threads):
    """With channels_last input the forward takes each image's RoIs by the band of map rows
    that holds their centres. RoIs over the whole height of a tall map, centres above and below
    it and on band edges, non-finite boxes and an image without RoIs: every RoI gets its own
    output and argmax, torchvision's bits, as NCHW input gives them, at any thread count."""
    x = tie_input((3, 40, 70, 9), seed=7, nan=0.02)  # bands of 8 rows: 9
    g = torch.Generator().manual_seed(8)
    k = 60
    centre = torch.stack([torch.rand(k, generator=g) * 9, torch.rand(k, generator=g) * 100 - 15], 1)
    half = torch.rand(k, 2, generator=g) * 12 + 0.5
    boxes = torch.cat([centre - half, centre + half], 1)
    boxes[:6, 1] = boxes[:6, 3] = torch.tensor([0.0, 8.0, 16.0, 63.999, 64.0, 70.0])
    boxes[6] = torch.tensor([math.nan, math.nan, 3.0, 5.0])
    boxes[7] = torch.tensor([1.0, -math.inf, 3.0, math.inf])
    boxes[8] = torch.tensor([1.0, 2.0, 3.0, math.inf])
    image = torch.randint(0, 2, (k, 1), generator=g).float() * 2  # images 0 and 2; none in 1
    rois = torch.cat([image, boxes], 1)
    want = op(x, rois, 1.0, 3, 4)
    finite = torch.isfinite(rois).all(1)
    tv = torch.ops.torchvision.roi_pool(x, rois[finite], 1.0, 3, 4)
    assert torch.equal(bits(want[0][finite]), bits(tv[0])) and torch.equal(want[1][finite], tv[1].int())
    xcl = x.contiguous(memory_format=torch.channels_last)
    out, arg = with_threads(threads, lambda: op(xcl, rois, 1.0, 3, 4))
    values = with_threads(threads, lambda: op_values(xcl, rois, 1.0, 3, 4))
    assert torch.equal(bits(out), bits(want[0])) and torch.equal(arg, want[1])
    assert torch.equal(bits(values), bits(want[0]))


def test_nan_and_inf_coordinates():
    x = distinct_input((1, 2, 6, 6))
    rois = torch.tensor([[0.0, float("nan"), 0, 3, 3], [0, 0, 0, float("inf"), float("inf")], [0, -1e30, -1e30, 1e30, 1e30]])
    out, arg = op(x, rois, 1.0, 2, 2)
    assert torch.equal(out[0], torch.zeros(2, 2, 2)) and (arg[0] == -1).all()
    # coordinates are clamped to +-2^30 pixels: a bin covering the whole map holds its maximum
    whole = x[0].flatten(1).max(1)
    assert torch.equal(out[1, :, 0, 0], whole.values) and torch.equal(arg[1, :, 0, 0], whole.indices.int())
    assert torch.equal(out[2, :, 1, 1], whole.values) and (arg[1:] < 36).all()


def test_legacy_entry_points():
    x = distinct_input((1, 2, 6, 6))
    rois = torch.tensor([[0.0, 0, 0, 5, 5]])
    out, arg = detops._C.roi_pool_forward(x, rois, 1.0, 2, 2)
    g = torch.ones_like(out)
    gi = detops._C.roi_pool_backward(g, x, rois, arg, 1.0, 2, 2, 1, 2, 6, 6)
    assert torch.equal(gi, op_bwd(g, rois, arg, 1.0, 2, 2, 1, 2, 6, 6))


# ----------------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scale,size", CASES)
def test_cuda_matches_cpu(dtype, scale, size):
    x = distinct_input((2, 3, 13, 17)).to(dtype)
    rois = random_rois(60, 2, 13, 17, scale).to(dtype)
    out, arg = op(x, rois, scale, *size)
    out_c, arg_c = op(x.cuda(), rois.cuda(), scale, *size)
    assert torch.equal(out_c.cpu(), out) and torch.equal(arg_c.cpu(), arg)
    out_cl, arg_cl = op(x.cuda().to(memory_format=torch.channels_last), rois.cuda(), scale, *size)
    assert torch.equal(out_cl.cpu(), out) and torch.equal(arg_cl.cpu(), arg)
    g = torch.randn(out.shape).to(dtype)
    gi = op_bwd(g, rois, arg, scale, *size, 2, 3, 13, 17)
    gi_c = op_bwd(g.cuda(), rois.cuda(), arg_c, scale, *size, 2, 3, 13, 17)
    tol = {torch.float16: 1e-2, torch.bfloat16: 5e-2}.get(dtype, 1e-5)
    torch.testing.assert_close(gi_c.cpu(), gi, atol=tol, rtol=tol)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_cuda_deterministic_backward(dtype):
    # many overlapping RoIs so that pixels collect many contributions
    x = distinct_input((2, 16, 32, 32)).to(dtype).cuda()
    rois = random_rois(300, 2, 32, 32, 0.5, seed=7).to(dtype).cuda()
    out, arg = op(x, rois, 0.5, 7, 7)
    g = torch.randn(out.shape, device="cuda").to(dtype)
    g_nc = torch.randn(out.shape[::-1], device="cuda").to(dtype).permute(3, 2, 1, 0)
    atomic = op_bwd(g, rois, arg, 0.5, 7, 7, 2, 16, 32, 32)
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = [op_bwd(g, rois, arg, 0.5, 7, 7, 2, 16, 32, 32) for _ in range(3)]
        runs_nc = [op_bwd(g_nc, rois, arg, 0.5, 7, 7, 2, 16, 32, 32) for _ in range(2)]
        xg = x.clone().requires_grad_()
        roi_pool(xg, rois, 7, 0.5).backward(g)
    finally:
        torch.use_deterministic_algorithms(prev)
    for r in runs[1:]:
        assert torch.equal(r, runs[0])
    assert torch.equal(runs_nc[0], runs_nc[1])
    assert torch.equal(xg.grad, runs[0])
    # same summation order as the CPU kernel
    cpu = op_bwd(g.cpu(), rois.cpu(), arg.cpu(), 0.5, 7, 7, 2, 16, 32, 32)
    assert torch.equal(runs[0].cpu(), cpu)
    tol = {torch.float16: 2e-2, torch.bfloat16: 1e-1}.get(dtype, 1e-5)
    torch.testing.assert_close(runs[0], atomic, atol=tol, rtol=tol)


@pytest.mark.cuda
@pytest.mark.parametrize("kernel", ["gather", "band"])
def test_cuda_invalid_batch_index_asserts(kernel):
    # the tile forward checks batch indices in its keys kernel, the gather kernels in a kernel
    # of their own; either way a device assertion names the op. It poisons the CUDA context,
    # so it fires in a child process.
    code = invalid_batch_index_code(kernel, "torch.ops.detops.roi_pool(x, rois, 1.0, 2, 2)")
    out = assert_fails_device_assert(code)
    assert "detops.roi_pool: rois[:, 0]" in out, out


@pytest.mark.cuda
@pytest.mark.parametrize("kernel", ["gather", "band"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_cuda_invalid_batch_index_asserts_backward(kernel, dtype):
    # the band backward checks batch indices in its setup (owner) kernel, the atomic backward
    # in a kernel of its own; either way a device assertion names the backward op
    grad = f"torch.ones(51, 3, 7, 7, device='cuda', dtype=torch.{dtype})"
    argmax = "torch.zeros(51, 3, 7, 7, device='cuda', dtype=torch.int32)"
    call = f"torch.ops.detops._roi_pool_backward({grad}, rois.to(torch.{dtype}), {argmax}, 1.0, 7, 7, 2, 3, 40, 40)"
    out = assert_fails_device_assert(invalid_batch_index_code(kernel, call))
    assert "detops.roi_pool backward: rois[:, 0]" in out, out


@pytest.mark.cuda
def test_cuda_autocast_and_compile():
    x = distinct_input((2, 3, 10, 10)).cuda().half()
    rois = random_rois(8, 2, 10, 10, 1.0).cuda()
    with torch.autocast("cuda", dtype=torch.float16):
        out = roi_pool(x, rois, 3)
    assert out.dtype == torch.float16
    assert torch.equal(out, op(x.float(), rois, 1.0, 3, 3)[0].half())
    f = torch.compile(lambda t, r: roi_pool(t, r, (3, 3), 1.0), fullgraph=True)
    xf = x.float()
    assert torch.equal(f(xf, rois), roi_pool(xf, rois, 3))


# ------------------------------------------------- CUDA forward kernels against the CPU kernel
#
# The CUDA forward has a rows kernel (channel-first layouts: lanes along a bin row, groups of
# lanes per bin, shuffled (value, index) combination) and a channels kernel (channels_last:
# lanes along the channels). Both must give the CPU kernel's values and argmax exactly; the
# backward is compared exactly too, with integer-valued gradients so that every summation
# order gives the same float sums.

FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
LAYOUTS = ["contiguous", "channels_last", "strided"]


def _layout(x, layout):
    """x in one memory layout; same values and shape."""
    if layout == "channels_last":
        return x.contiguous(memory_format=torch.channels_last)
    if layout == "strided":  # a view with no unit-stride dimension
        big = torch.zeros(x.shape[0], x.shape[1] * 2, x.shape[2], x.shape[3] * 3, dtype=x.dtype, device=x.device)
        big[:, ::2, :, ::3] = x
        return big[:, ::2, :, ::3]
    return x.contiguous()


def _integer_grad(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=g).to(dtype)


def _check_cuda_against_cpu(x, rois, scale, ph, pw, layouts=LAYOUTS, backward=True):
    """Forward (values, argmax), the forward without argmax (_roi_pool_values) and both
    backward variants on CUDA equal the CPU kernel (output bits, zero signs included), with the
    gather kernels and with the shared-memory kernels (the tile forward, any layout; the band
    backward)."""
    from detops.ops._utils import roi_kernel

    out, arg = op(x, rois, scale, ph, pw)
    b, c, h, w = x.shape
    g = _integer_grad(out.shape, x.dtype)
    gi = op_bwd(g, rois, arg, scale, ph, pw, b, c, h, w) if backward else None
    for kernel in ("gather", "band"):
        with roi_kernel(kernel):
            for layout in layouts:
                xc = _layout(x.cuda(), layout)
                out_c, arg_c = op(xc, rois.cuda(), scale, ph, pw)
                assert torch.equal(bits(out_c.cpu()), bits(out)), (kernel, layout)
                assert torch.equal(arg_c.cpu(), arg), (kernel, layout)
                values = op_values(xc, rois.cuda(), scale, ph, pw)  # without argmax
                assert torch.equal(bits(values.cpu()), bits(out)), (kernel, layout)
            if not backward:
                continue
            gi_c = op_bwd(g.cuda(), rois.cuda(), arg.cuda(), scale, ph, pw, b, c, h, w)
            assert gi_c.dtype == gi.dtype
            assert torch.equal(gi_c.cpu(), gi), kernel
            prev = torch.are_deterministic_algorithms_enabled()
            torch.use_deterministic_algorithms(True)
            try:
                gi_d = op_bwd(g.cuda(), rois.cuda(), arg.cuda(), scale, ph, pw, b, c, h, w)
            finally:
                torch.use_deterministic_algorithms(prev)
            assert torch.equal(gi_d.cpu(), gi), kernel


def _wide_rois(batch, height, width):
    """RoIs (scale 1) wider than 32 lanes' worth of columns, tall ones, the whole map, and
    ones hanging over each border."""
    boxes = [
        [0, 0, 0, width - 1, height - 1],
        [0, 3, 1, width - 2, 5],
        [0, 0.4, 2, 37.6, height - 3],
        [0, -40, -7, width + 40, height + 9],
        [0, width - 50, -20, width + 60, 4],
        [0, -70, 3, 45, 9],
        [0, 5, 5, 5, 5],
        [0, 100.5, 0, 100.5, height - 1],
    ]
    rois = torch.tensor(boxes, dtype=torch.float32)
    rois[1::2, 0] = batch - 1
    return rois


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("scale,size", CASES + [(0.25, (14, 14)), (1.0, (40, 3)), (1.0, (3, 40))])
def test_cuda_kernels_match_cpu(dtype, scale, size):
    x = distinct_input((2, 37, 13, 17)).to(dtype)  # 37 channels: one full and one partial group of 32
    rois = random_rois(60, 2, 13, 17, scale).to(dtype)
    _check_cuda_against_cpu(x, rois, scale, *size)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("size", [(1, 1), (7, 7), (2, 5), (5, 33), (1, 64), (24, 24)])
def test_cuda_wide_and_huge_rois(dtype, size):
    # columns per bin from < 1 to > 160, more bins in a row than a warp has lanes; 24 x 24 bins
    # are more than the tile forward's transpose takes, so its outputs are written in place
    x = distinct_input((2, 3, 21, 203)).to(dtype)
    rois = _wide_rois(2, 21, 203).to(dtype)
    _check_cuda_against_cpu(x, rois, 1.0, *size)


def _negative_then_zeros(shape, seed=5):
    """-1 (80%), -0.0 and +0.0: most bins' maxima are zero, and their first zero in row-major
    order (the maximum the sequential scan keeps, sign included) comes after a few -1."""
    u = torch.rand(shape, generator=torch.Generator().manual_seed(seed))
    return torch.where(u < 0.8, -1.0, torch.where(u < 0.9, -0.0, 0.0))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_cuda_ties(dtype):
    # constant features: every bin ties everywhere and takes its first pixel in row-major
    # order; then a few distinct values (ties within and across columns), +0.0 / -0.0, and
    # maps where the first zero of a bin whose maximum is zero comes after negative values
    rois = torch.cat([_wide_rois(2, 19, 150), random_rois(40, 2, 19, 150, 1.0, seed=11)]).to(dtype)
    for x in (
        torch.full((2, 33, 19, 150), 1.5),
        torch.randint(0, 3, (2, 33, 19, 150), generator=torch.Generator().manual_seed(1)).float(),
        torch.where(torch.rand(2, 33, 19, 150, generator=torch.Generator().manual_seed(2)) < 0.5, 0.0, -0.0),
        _negative_then_zeros((2, 33, 19, 150)),
    ):
        for size in ((7, 7), (3, 2), (1, 1)):
            _check_cuda_against_cpu(x.to(dtype), rois, 1.0, *size)
    out, arg = op(torch.full((1, 2, 19, 150), 1.5).to(dtype).cuda(), rois[:1].cuda(), 1.0, 1, 1)
    assert (arg == 0).all()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_cuda_nan_inf_and_lowest(dtype):
    # NaN never becomes a maximum; a bin of NaN / -inf / -FLT_MAX only keeps argmax -1 and
    # the value -FLT_MAX (converted to the dtype); partly NaN bins take their largest number
    g = torch.Generator().manual_seed(3)
    x = distinct_input((2, 34, 16, 90))
    u = torch.rand(x.shape, generator=g)
    x = torch.where(u < 0.3, float("nan"), x)
    x = torch.where((u >= 0.3) & (u < 0.35), float("-inf"), x)
    x[:, :, :, :20] = float("nan")  # whole bins of NaN
    x[:, :, :, 20:24] = -3.4028234663852886e38
    x[:, :, 10:, 30:40] = float("inf")
    rois = torch.cat([_wide_rois(2, 16, 90), random_rois(40, 2, 16, 90, 1.0, seed=12)])
    if dtype in (torch.float16, torch.bfloat16):
        x[:, :, :, 20:24] = float("-inf")  # -FLT_MAX does not fit
    _check_cuda_against_cpu(x.to(dtype), rois.to(dtype), 1.0, 7, 7)
    _check_cuda_against_cpu(x.to(dtype), rois.to(dtype), 1.0, 3, 11)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_benchmark_shapes(dtype):
    # the benchmark's geometry (RoI sides 1/32 to 1/2 of the image, stride 4), fewer channels
    x = torch.randn(2, 40, 100, 152, generator=torch.Generator().manual_seed(4)).to(dtype)
    rois = bench_rois(96, 2, 100, 152, seed=4, spatial_scale=0.25).to(dtype)
    _check_cuda_against_cpu(x, rois, 0.25, 7, 7)
    if dtype == torch.float32:  # torchvision computes half-precision RoI geometry in half
        tv = torchvision.ops.roi_pool(x.cuda(), rois.cuda(), 7, 0.25)
        assert torch.equal(op(x.cuda(), rois.cuda(), 0.25, 7, 7)[0], tv)


@pytest.mark.cuda
@pytest.mark.parametrize("side", [300, 1300])
def test_cuda_tile_forward_many_tiles(side):
    # the tile forward lists its bins with a many-block scatter up to 4096 keys (tiles plus
    # one) and with the one-block grouping past them: a 1300 x 1300 map has more than 4096
    # tiles on any GPU (their side is at most about 20 pixels)
    x = distinct_input((1, 3, side, side), seed=side)
    rois = bench_rois(300, 1, side, side, seed=side)
    _check_cuda_against_cpu(x, rois, 1.0, 7, 7, layouts=("contiguous",), backward=False)


@pytest.mark.cuda
def test_cuda_single_channel_and_empty_rois():
    # C = 1 channels_last is also contiguous: the rows kernel takes it; RoIs entirely
    # outside the map or with NaN coordinates have only empty bins
    x = distinct_input((2, 1, 9, 40))
    rois = torch.tensor(
        [[0.0, -50, -50, -10, -10], [1, 45, 0, 60, 8], [1, float("nan"), 0, 4, 4], [0, 0, 0, 39, 8]]
    )
    _check_cuda_against_cpu(x, rois, 1.0, 2, 3)
    out, arg = op(x.cuda(), rois.cuda(), 1.0, 2, 3)
    assert (arg[:3] == -1).all() and (out[:3] == 0).all() and (arg[3] >= 0).all()


@pytest.mark.cuda
def test_cuda_backward_fp16_accumulates_in_float32():
    # 300 RoIs on the same pixel: float32 accumulation, one rounding at the end
    x = torch.zeros(1, 2, 4, 4, dtype=torch.float16)
    x[0, :, 1, 1] = 1
    rois = torch.tensor([[0.0, 0, 0, 3, 3]]).repeat(300, 1).half()
    _, arg = op(x.cuda(), rois.cuda(), 1.0, 1, 1)
    g = torch.full((300, 2, 1, 1), 0.1, dtype=torch.float16)
    gi = op_bwd(g.cuda(), rois.cuda(), arg, 1.0, 1, 1, 1, 2, 4, 4)
    want = op_bwd(g, rois, arg.cpu(), 1.0, 1, 1, 1, 2, 4, 4)
    assert torch.equal(gi.cpu(), want)
    assert gi[0, 0, 1, 1].item() == torch.tensor(300 * 0.0999755859375).half().item()


# ------------------------------------------------- CUDA shared-memory kernels
#
# (batch, channels, height, width, rois, min side, max side, spill, pooled size).
# Forward (tiles): on an SM with 227 KiB of shared memory a block stages windows of up to
# 1551 pixels (775 for float64) around tiles of 19 x 19 (13 x 13); bins larger than a window
# ("bands, tall bins", "spilling RoIs") are read from global memory; 1300 RoIs on one 64 x 64
# map give tiles more bins than a block holds at once (several rounds); 70 channels make full
# and partial channel groups (32 channels per group, 64 for 16-bit types).
# Backward (bands): float32 planes 600 wide stage 27-row windows (5 bands of 21 rows for
# H = 100), so RoIs 90 rows tall have bins taller than the 6-row overlap (added by the tail
# kernel); the 1300 RoIs give one block more bin rows than it holds ids for in shared memory.
POOL_BAND_CASES = {
    "one band": (2, 8, 40, 56, 300, 2, 30, 0.0, (7, 7)),
    "bands, tall bins": (1, 5, 100, 600, 400, 2, 90, 0.1, (7, 7)),
    "odd sizes": (3, 4, 97, 301, 500, 1, 97, 0.2, (14, 14)),
    "spilling RoIs": (2, 3, 120, 400, 200, 4, 200, 0.5, (3, 5)),
    "many RoIs": (1, 3, 64, 64, 1300, 1, 20, 0.0, (7, 7)),
    "channel groups": (2, 70, 50, 76, 256, 2, 40, 0.0, (7, 7)),
}


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("case", sorted(POOL_BAND_CASES))
def test_cuda_band_kernels_match_cpu(case, dtype):
    batch, c, h, w, k, lo, hi, spill, pooled = POOL_BAND_CASES[case]
    x = distinct_input((batch, c, h, w), seed=len(case)).to(dtype)
    rois = dense_rois(batch, k, h, w, lo, hi, 0.25, seed=k, spill=spill).to(dtype)
    _check_cuda_against_cpu(x, rois, 0.25, *pooled)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_band_backward_adds_any_argmax(dtype):
    # the backward op takes any argmax in [-1, H * W): pixels outside the bands of a bin's rows
    # are added too (after the bands, with atomics in grad's dtype). Out-of-range values, which
    # the CPU kernel rejects, add nothing on CUDA (checking them would need a host sync).
    from detops.ops._utils import roi_kernel

    b, c, h, w = 2, 3, 100, 600
    rois = dense_rois(b, 300, h, w, 2, 60, 1.0, seed=2).to(dtype)
    g = _integer_grad((300, c, 7, 7), dtype, seed=3)
    gen = torch.Generator().manual_seed(4)
    arg = torch.randint(-1, h * w, (300, c, 7, 7), generator=gen, dtype=torch.int32)
    want = op_bwd(g, rois, arg, 1.0, 7, 7, b, c, h, w)
    bad = arg.clone()
    out_of_range = torch.rand(arg.shape, generator=gen) < 0.1
    bad[out_of_range] = torch.where(torch.rand(arg.shape, generator=gen) < 0.5, -7, h * w + 3).int()[out_of_range]
    want_bad = op_bwd(g, rois, torch.where(out_of_range, -1, arg), 1.0, 7, 7, b, c, h, w)
    for kernel in ("band", "gather"):
        with roi_kernel(kernel):
            assert torch.equal(op_bwd(g.cuda(), rois.cuda(), arg.cuda(), 1.0, 7, 7, b, c, h, w).cpu(), want)
            assert torch.equal(op_bwd(g.cuda(), rois.cuda(), bad.cuda(), 1.0, 7, 7, b, c, h, w).cpu(), want_bad)


@pytest.mark.cuda
def test_cuda_band_kernels_run_when_chosen():
    # Under 'auto' the shared-memory kernels (tile forward, band backward) run for bins dense
    # on the map, the gather kernels for sparse ones and for the deterministic backward; the
    # tile forward takes channels_last input too, and needs 16 channels or more.
    from torch.profiler import ProfilerActivity, profile

    from detops.ops._utils import roi_kernel

    x = torch.randn(2, 16, 100, 152, device="cuda", requires_grad=True)
    dense = bench_rois(512, 2, 100, 152, seed=1, spatial_scale=0.25).cuda()

    def kernels(kernel, inp, rois):
        with roi_kernel(kernel), profile(activities=[ProfilerActivity.CUDA]) as prof:
            roi_pool(inp, rois, 7, 0.25).sum().backward()
            torch.cuda.synchronize()
        return " ".join(e.name for e in prof.events())

    names = kernels("auto", x, dense)
    assert "tile_forward" in names and "band_backward" in names
    names = kernels("auto", x, dense[:8])
    assert "tile_" not in names and "band_" not in names
    names = kernels("gather", x, dense)
    assert "tile_" not in names and "band_" not in names
    names = kernels("band", x, dense[:8])
    assert "tile_forward" in names and "band_backward" in names
    xcl = x.detach().contiguous(memory_format=torch.channels_last).requires_grad_()
    assert "tile_forward" in kernels("auto", xcl, dense)
    # fewer channels than half a warp's lanes: the rows kernel, unless the tiles are forced
    narrow = torch.randn(2, 8, 100, 152, device="cuda", requires_grad=True)
    assert "tile_forward" not in kernels("auto", narrow, dense)
    assert "tile_forward" in kernels("band", narrow, dense)
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert "band_backward" not in kernels("band", x, dense)
    finally:
        torch.use_deterministic_algorithms(prev)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 3])
def test_cpu_backward_writes_every_element(dtype, threads):
    # grad_input is allocated uninitialized and written whole by the kernel's tasks: a freed
    # tensor of the same size full of junk is handed out again by the allocator, so an element
    # left unwritten would show (image 1 has no RoIs, its planes must come back zero)
    x = distinct_input((3, 5, 12, 14), dtype=dtype)
    rois = random_rois(40, 3, 12, 14, 0.5, seed=7, dtype=dtype)
    rois[:, 0] = torch.where(rois[:, 0] == 1, 2.0, rois[:, 0]).to(dtype)
    g = _integer_grad((40, 5, 3, 4), dtype, seed=8)
    _, arg = op(x, rois, 0.5, 3, 4)
    want = ref.roi_pool_backward(g.double(), rois.double(), arg, 3, 5, 12, 14).to(dtype)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(3):
            junk = torch.full((3, 5, 12, 14), 1234.0, dtype=dtype)
            del junk
            got = op_bwd(g, rois, arg, 0.5, 3, 4, 3, 5, 12, 14)
            assert torch.equal(got, want)
            assert got[1].abs().max() == 0
    finally:
        torch.set_num_threads(prev)


@pytest.mark.parametrize("threads", [1, 3])
def test_cpu_outputs_past_the_huge_page_size_match_torchvision(threads):
    # every element of outputs (and argmax) the kernels ask huge pages for is still written
    (out, grad_x), (want, want_grad) = large_output_case(
        lambda x, rois: roi_pool(x, rois, 7, 1.0),
        lambda x, rois: torchvision.ops.roi_pool(x, rois, 7, 1.0),
        threads,
    )
    assert torch.equal(out, want)
    assert torch.equal(grad_x, want_grad)
