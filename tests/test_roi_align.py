"""roi_align: agreement with torchvision and with the float64 reference, gradients, layouts,
empty inputs, torch.library registrations, autocast, argument checks, and (on a GPU) CPU/CUDA
agreement and the deterministic backward."""
import contextlib
import math

import pytest
import torch
import torchvision

import detops  # noqa: F401  (loads the ops)
from detops.ops import RoIAlign, roi_align
from detops.reference.roi_align import roi_align as ref_roi_align
from tests.conftest import (
    DEVICES,
    assert_fails_device_assert,
    dense_rois,
    invalid_batch_index_code,
    large_output_case,
    op_python_called,
    with_threads,
)

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float64: dict(atol=1e-12, rtol=1e-12)}
# Output rounding of the low-precision dtypes, relative to the largest magnitude.
LOW_TOL = {torch.float16: 1e-3, torch.bfloat16: 8e-3}

# Boxes in feature-map pixels of a 12 x 10 (H x W) map; divided by spatial_scale before use.
EDGE_BOXES = [
    (1.3, 2.2, 7.8, 9.1),  # inside
    (-3.0, -2.0, 4.0, 5.0),  # partly outside, top-left
    (6.0, 7.0, 14.0, 15.0),  # partly outside, bottom-right
    (20.0, 20.0, 30.0, 30.0),  # wholly outside
    (-10.0, -10.0, -5.0, -4.0),  # wholly outside, negative
    (3.2, 4.1, 3.3, 4.15),  # tiny
    (5.0, 5.0, 2.0, 3.0),  # inverted
    (4.0, 4.0, 4.0, 4.0),  # a point
    (0.0, 0.0, 10.0, 12.0),  # the whole map
    (-1.0, -1.0, 11.0, 13.0),  # the map and its one-pixel border
    (-25.0, -30.0, 35.0, 40.0),  # huge
]


def edge_rois(batch: int, scale: float, dtype, device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    boxes = torch.tensor(EDGE_BOXES, dtype=torch.float64)
    # plus random boxes, some spilling over the border
    xy = torch.rand(12, 2, generator=g, dtype=torch.float64) * torch.tensor([12.0, 14.0]) - 2
    wh = torch.rand(12, 2, generator=g, dtype=torch.float64) * 8
    boxes = torch.cat([boxes, torch.cat([xy, xy + wh], 1)]) / scale
    idx = torch.randint(0, batch, (boxes.size(0), 1), generator=g).double()
    return torch.cat([idx, boxes], 1).to(dtype=dtype, device=device)


def features(batch=2, channels=3, height=12, width=10, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, channels, height, width, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)


def tv_roi_align(x, rois, output_size, scale, sampling_ratio, aligned):
    return torchvision.ops.roi_align(x, rois, output_size, scale, sampling_ratio, aligned)


CASES = [
    (aligned, sr, scale)
    for aligned in (False, True)
    for sr in (-1, 0, 2)
    for scale in (0.25, 0.5)
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("aligned,sampling_ratio,scale", CASES)
def test_forward_matches_torchvision_and_reference(device, dtype, aligned, sampling_ratio, scale):
    x = features(dtype=dtype, device=device)
    rois = edge_rois(2, scale, dtype, device)
    out = roi_align(x, rois, (3, 4), scale, sampling_ratio, aligned)
    assert out.shape == (rois.size(0), 3, 3, 4) and out.dtype == dtype and out.is_contiguous()
    expected = tv_roi_align(x.cpu(), rois.cpu(), (3, 4), scale, sampling_ratio, aligned)
    torch.testing.assert_close(out.cpu(), expected, **TOL[dtype])
    ref = ref_roi_align(x.cpu(), rois.cpu(), (3, 4), scale, sampling_ratio, aligned)
    torch.testing.assert_close(out.cpu().double(), ref, **({"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else TOL[dtype]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("aligned,sampling_ratio", [(False, -1), (True, 2), (True, 0)])
def test_forward_low_precision(device, dtype, aligned, sampling_ratio):
    scale = 0.5
    x = features(dtype=dtype, device=device)
    rois = edge_rois(2, scale, dtype, device)
    out = roi_align(x, rois, 3, scale, sampling_ratio, aligned)
    assert out.dtype == dtype
    # the reference on the same rounded values
    ref = ref_roi_align(x.cpu().double(), rois.cpu().double(), (3, 3), scale, sampling_ratio, aligned)
    tol = LOW_TOL[dtype] * max(1.0, ref.abs().max().item())
    torch.testing.assert_close(out.cpu().double(), ref, atol=tol, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_list_of_boxes(device):
    x = features(batch=3, device=device)
    boxes = [
        torch.tensor([[1.0, 1.0, 6.0, 5.0], [0.5, 2.0, 9.0, 11.0]], device=device),
        torch.zeros(0, 4, device=device),
        torch.tensor([[2.0, 3.0, 4.5, 8.0]], device=device),
    ]
    out = roi_align(x, boxes, 2, 1.0, 2, True)
    rois = torch.tensor(
        [[0, 1.0, 1.0, 6.0, 5.0], [0, 0.5, 2.0, 9.0, 11.0], [2, 2.0, 3.0, 4.5, 8.0]], device=device
    )
    torch.testing.assert_close(out, roi_align(x, rois, 2, 1.0, 2, True), atol=0, rtol=0)
    torch.testing.assert_close(out.cpu(), tv_roi_align(x.cpu(), [b.cpu() for b in boxes], 2, 1.0, 2, True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("aligned,sampling_ratio,scale", [(False, -1, 0.5), (True, 2, 0.25), (True, 0, 0.5)])
def test_backward_matches_torchvision_and_reference(device, dtype, aligned, sampling_ratio, scale):
    x = features(batch=3, dtype=dtype, device=device).requires_grad_()
    rois = edge_rois(2, scale, dtype, device)  # image 2 has no RoIs
    w = torch.randn(rois.size(0), 3, 2, 3, dtype=dtype, generator=torch.Generator().manual_seed(1)).to(device)
    (roi_align(x, rois, (2, 3), scale, sampling_ratio, aligned) * w).sum().backward()
    xt = x.detach().cpu().requires_grad_()
    (tv_roi_align(xt, rois.cpu(), (2, 3), scale, sampling_ratio, aligned) * w.cpu()).sum().backward()
    torch.testing.assert_close(x.grad.cpu(), xt.grad, **TOL[dtype])
    xr = x.detach().cpu().requires_grad_()
    (ref_roi_align(xr, rois.cpu(), (2, 3), scale, sampling_ratio, aligned) * w.cpu().double()).sum().backward()
    torch.testing.assert_close(x.grad.cpu().double(), xr.grad.double(), **({"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else TOL[dtype]))
    assert x.grad[2].abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_backward_low_precision_cpu(dtype):
    x = features(dtype=dtype).requires_grad_()
    rois = edge_rois(2, 0.5, dtype, "cpu")
    roi_align(x, rois, 2, 0.5, 2, True).sum().backward()
    xr = x.detach().double().requires_grad_()
    ref_roi_align(xr, rois.double(), (2, 2), 0.5, 2, True).sum().backward()
    assert x.grad.dtype == dtype
    tol = LOW_TOL[dtype] * max(1.0, xr.grad.abs().max().item())
    torch.testing.assert_close(x.grad.double(), xr.grad, atol=tol, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("aligned,sampling_ratio", [(False, 2), (True, -1)])
def test_gradcheck(device, aligned, sampling_ratio):
    x = features(batch=2, channels=2, height=6, width=5, dtype=torch.float64, device=device).requires_grad_()
    rois = torch.tensor(
        [[0, 0.3, 0.7, 3.9, 4.6], [1, -1.2, 1.1, 6.5, 3.3], [1, 2.0, 2.0, 2.6, 2.9]],
        dtype=torch.float64,
        device=device,
    )
    assert torch.autograd.gradcheck(lambda t: roi_align(t, rois, (2, 2), 1.0, sampling_ratio, aligned), (x,))
    assert torch.autograd.gradcheck(
        lambda t: torch.ops.detops.roi_align(t, rois, 1.0, 2, 2, sampling_ratio, aligned), (x,)
    )


@pytest.mark.parametrize("device", DEVICES)
def test_layouts(device):
    x = features(batch=2, channels=4, device=device)
    rois = edge_rois(2, 0.5, torch.float32, device)
    expected = roi_align(x, rois, 3, 0.5, 2, False)
    x_cl = x.to(memory_format=torch.channels_last)
    x_nc = features(batch=2, channels=8, device=device)[:, ::2]  # strided channels
    x_nc.copy_(x)
    rois_nc = torch.cat([rois, rois], 1)[:, ::2]  # column stride 2
    rois_nc.copy_(rois)
    assert not x_cl.is_contiguous() and not x_nc.is_contiguous() and not rois_nc.is_contiguous()
    for xi, ri in ((x_cl, rois), (x_nc, rois_nc)):
        xi = xi.detach().requires_grad_()
        out = roi_align(xi, ri, 3, 0.5, 2, False)
        assert out.is_contiguous()
        torch.testing.assert_close(out, expected, atol=0, rtol=0)
        out.sum().backward()
        xc = x.detach().requires_grad_()
        roi_align(xc, rois, 3, 0.5, 2, False).sum().backward()
        # the CUDA backward adds with atomics: the order, hence the last bit, may differ
        tol = 0 if device == "cpu" else 1e-6
        torch.testing.assert_close(xi.grad, xc.grad, atol=tol, rtol=tol)
    # a non-contiguous grad
    xg = x.detach().requires_grad_()
    out = roi_align(xg, rois, 3, 0.5, 2, False)
    out.backward(torch.ones(1, 1, 1, 1, device=device).expand_as(out))
    torch.testing.assert_close(xg.grad, xc.grad, atol=tol, rtol=tol)


@pytest.mark.parametrize("device", DEVICES)
def test_empty(device):
    x = features(batch=2, channels=3, device=device).requires_grad_()
    rois = torch.zeros(0, 5, device=device)
    out = roi_align(x, rois, (2, 3), 1.0, 2, True)
    assert out.shape == (0, 3, 2, 3)
    out.sum().backward()
    assert x.grad.shape == x.shape and x.grad.abs().max() == 0
    # no channels
    x0 = torch.zeros(2, 0, 4, 4, device=device)
    assert roi_align(x0, torch.tensor([[0, 0.0, 0, 2, 2]], device=device), 2).shape == (1, 0, 2, 2)
    # backward op with K = 0
    g = torch.ops.detops._roi_align_backward(torch.zeros(0, 3, 2, 3, device=device), rois, 1.0, 2, 3, 2, 3, 4, 5, 2, True)
    assert g.shape == (2, 3, 4, 5) and g.abs().max() == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sampling_ratio", [-1, 2])
def test_non_finite_boxes_read_nothing(device, sampling_ratio):
    x = features(device=device).requires_grad_()
    nan, inf = math.nan, math.inf
    rois = torch.tensor(
        [[0, nan, 1.0, 5.0, 5.0], [1, 1.0, 1.0, inf, 5.0], [0, -inf, -inf, inf, inf], [1, 1.0, 2.0, 6.0, 7.0]],
        device=device,
    )
    out = roi_align(x, rois, 2, 1.0, sampling_ratio, True)
    assert torch.isfinite(out).all()
    assert out[0].abs().max() == 0 and out[2].abs().max() == 0
    torch.testing.assert_close(out[3:], roi_align(x, rois[3:], 2, 1.0, sampling_ratio, True))
    out.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_backward_is_thread_count_independent():
    x = features(batch=2, channels=5, height=16, width=16).requires_grad_()
    rois = edge_rois(2, 0.5, torch.float32, "cpu")
    grads = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            x.grad = None
            roi_align(x, rois, 3, 0.5, -1, True).pow(2).sum().backward()
            grads.append(x.grad.clone())
    finally:
        torch.set_num_threads(threads)
    for g in grads[1:]:
        assert torch.equal(g, grads[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("channels", [1, 7, 8, 13, 40])
def test_cpu_channels_last_and_threads_agree(dtype, channels):
    """The channels_last path (read in place) and the NCHW path (channel blocks) give the same
    bits, and so does any thread count, forward and backward; float32 also matches
    torchvision. Channel counts cover whole and partial blocks."""
    x = features(batch=3, channels=channels, height=16, width=13, dtype=dtype)
    rois = torch.cat([edge_rois(3, 0.5, dtype, "cpu", seed=s) for s in range(3)])
    rois[:, 0] = rois[:, 0].clamp(max=1)  # image 2 has no RoIs; the others have different counts
    rois[::3, 0] = 0
    grad = torch.randn(rois.size(0), channels, 3, 4, generator=torch.Generator().manual_seed(2)).to(dtype)

    def run(t, n):
        def f():
            t_ = t.detach().requires_grad_()
            out = roi_align(t_, rois, (3, 4), 0.5, -1, True)
            out.backward(grad)
            return out, t_.grad
        return with_threads(n, f)

    out, g = run(x, 1)
    for xi, n in ((x, 2), (x, 3), (x.to(memory_format=torch.channels_last), 1), (x.to(memory_format=torch.channels_last), 3)):
        out_i, g_i = run(xi, n)
        assert out_i.is_contiguous()
        assert torch.equal(out_i, out) and torch.equal(g_i.contiguous(), g)
    assert g[2].abs().max() == 0
    if dtype == torch.float32:
        assert torch.equal(out, tv_roi_align(x, rois, (3, 4), 0.5, -1, True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("threads", [1, 3])
def test_cpu_channels_last_input_gets_channels_last_grad(dtype, threads):
    """A CPU input stored channels_last gets its gradient in that layout (the autograd copies
    the backward's NCHW planes through _to_channels_last) with the NCHW input's bits, as a leaf
    and behind another op; an input that is both layouts at once (one channel) gets the
    backward's own tensor."""
    for channels in (24, 1):
        x = features(batch=2, channels=channels, height=16, width=13, dtype=dtype)
        rois = torch.cat([edge_rois(2, 0.5, dtype, "cpu", seed=s) for s in range(2)])
        grad = torch.randn(rois.size(0), channels, 3, 4, generator=torch.Generator().manual_seed(4)).to(dtype)

        def grad_of(t):
            # torch.autograd.grad: the gradient as the op's backward returns it (a leaf's .grad
            # would be copied into the leaf's layout by AccumulateGrad in any case)
            t = t.detach().requires_grad_()
            return with_threads(threads, lambda: torch.autograd.grad(roi_align(t, rois, (3, 4), 0.5, 2, True), t, grad))[0]

        want = grad_of(x)
        got = grad_of(x.to(memory_format=torch.channels_last))
        assert want.is_contiguous()
        assert got.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(got, want)
        if channels > 1:
            assert not got.is_contiguous()
            # behind another op: the leaf is NCHW, the op's input a channels_last copy of it
            leaf = x.detach().requires_grad_()
            with_threads(threads, lambda: roi_align(
                leaf.to(memory_format=torch.channels_last), rois, (3, 4), 0.5, 2, True).backward(grad))
            assert leaf.grad.is_contiguous() and torch.equal(leaf.grad, want)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_cuda_channels_last_input_gets_channels_last_grad(dtype):
    """A CUDA input stored channels_last gets its gradient in that layout too (the backward's
    NCHW planes through _to_channels_last's tiled transpose): bit for bit the NCHW input's under
    deterministic algorithms, close to it with the atomic backward; as a leaf, as the op's
    backward returns it, and behind another op. 35 channels and 21x13 pixels leave partial tiles
    of 32 on both axes."""
    x = features(batch=3, channels=35, height=21, width=13, dtype=dtype, device="cuda", seed=7)
    rois = torch.cat([edge_rois(3, 0.5, dtype, "cuda", seed=s) for s in range(3)])
    grad = torch.randn(rois.size(0), 35, 3, 4, generator=torch.Generator().manual_seed(8)).to(dtype=dtype, device="cuda")
    xcl = x.to(memory_format=torch.channels_last)
    for deterministic in (True, False):
        with deterministic_algorithms(deterministic):
            (want,) = torch.autograd.grad(roi_align(x.requires_grad_(), rois, (3, 4), 0.5, 2, True), x, grad)
            (got,) = torch.autograd.grad(roi_align(xcl.requires_grad_(), rois, (3, 4), 0.5, 2, True), xcl, grad)
            leaf = xcl.detach().requires_grad_()
            roi_align(leaf, rois, (3, 4), 0.5, 2, True).backward(grad)
            behind = x.detach().requires_grad_()
            roi_align(behind.to(memory_format=torch.channels_last), rois, (3, 4), 0.5, 2, True).backward(grad)
        assert want.is_contiguous() and behind.grad.is_contiguous()
        for g in (got, leaf.grad):
            assert g.is_contiguous(memory_format=torch.channels_last) and not g.is_contiguous()
        if deterministic:
            for g in (got, leaf.grad, behind.grad):
                assert torch.equal(g, want)
        else:
            tol = dict(atol=1e-2, rtol=1e-2) if dtype in LOW_TOL else TOL[dtype]
            for g in (got, leaf.grad, behind.grad):
                torch.testing.assert_close(g, want, **tol)
        x, xcl = x.detach(), xcl.detach()


@pytest.mark.parametrize("threads", [1, 3])
def test_cpu_channels_last_rois_in_centre_bands(threads):
    """With channels_last input the forward takes each image's RoIs by the band of map rows
    that holds their centres. RoIs over the whole height of a tall map, centres above and below
    it and on band edges, non-finite boxes and an image without RoIs: every RoI gets its own
    output, bit for bit the NCHW path's, at any thread count."""
    x = features(batch=3, channels=40, height=70, width=9, seed=5)  # bands of 8 rows: 9
    g = torch.Generator().manual_seed(6)
    k = 60
    centre = torch.stack([torch.rand(k, generator=g, dtype=torch.float64) * 9,
                          torch.rand(k, generator=g, dtype=torch.float64) * 100 - 15], 1)
    half = torch.rand(k, 2, generator=g, dtype=torch.float64) * 12 + 0.5
    boxes = torch.cat([centre - half, centre + half], 1)
    boxes[:6, 1] = boxes[:6, 3] = torch.tensor([0.0, 8.0, 16.0, 63.999, 64.0, 70.0], dtype=torch.float64)
    boxes[6] = torch.tensor([math.nan, math.nan, 3.0, 5.0])
    boxes[7] = torch.tensor([1.0, -math.inf, 3.0, math.inf])
    boxes[8] = torch.tensor([1.0, 2.0, 3.0, math.inf])
    image = torch.randint(0, 2, (k, 1), generator=g).double() * 2  # images 0 and 2; none in 1
    rois = torch.cat([image, boxes], 1).float()
    nchw = roi_align(x, rois, (3, 4), 1.0, 2, True)
    out = with_threads(threads, lambda: roi_align(x.to(memory_format=torch.channels_last), rois, (3, 4), 1.0, 2, True))
    assert torch.equal(out, nchw)
    finite = torch.isfinite(rois).all(1)
    assert torch.equal(out[finite], tv_roi_align(x, rois[finite], (3, 4), 1.0, 2, True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("sampling_ratio", [-1, 2])
def test_cpu_backward_row_bands_give_the_same_bits(dtype, aligned, sampling_ratio):
    """Where the backward's chunks of planes leave a thread fewer than four, it cuts each chunk
    into bands of rows, a task adding only what lands in its rows. Here 1 thread adds whole
    planes (4 chunks), and 2, 4 and 16 threads cut 6, 6 and 16 chunks into 2, 3 and 4 bands:
    all give the same bits, which match torchvision. The RoIs cross band edges and spill off
    the map; one has a negative size (aligned) and one lies on the last rows, whose samples
    read a single row twice."""
    x = features(batch=2, channels=24, height=100, width=23, dtype=dtype, seed=3)
    g = torch.Generator().manual_seed(7)
    xy = torch.rand(40, 2, generator=g, dtype=torch.float64) * torch.tensor([23.0, 100.0]) - 3
    wh = torch.rand(40, 2, generator=g, dtype=torch.float64) * torch.tensor([12.0, 60.0])
    extra = torch.tensor([[2.0, 95.0, 20.0, 99.9], [5.0, 40.0, 1.0, 30.0], [-5.0, -8.0, 30.0, 110.0]], dtype=torch.float64)
    boxes = torch.cat([torch.cat([xy, xy + wh], 1), extra])
    rois = torch.cat([torch.randint(0, 2, (boxes.size(0), 1), generator=g).double(), boxes], 1).to(dtype)
    grad = torch.randn(rois.size(0), 24, 3, 4, generator=g, dtype=torch.float64).to(dtype)

    def backward(n):
        return with_threads(n, lambda: torch.ops.detops._roi_align_backward(
            grad, rois, 1.0, 3, 4, 2, 24, 100, 23, sampling_ratio, aligned))

    want = backward(1)
    for n in (2, 4, 16):
        assert torch.equal(backward(n), want), n
    xt = x.detach().requires_grad_()
    tv_roi_align(xt, rois, (3, 4), 1.0, sampling_ratio, aligned).backward(grad)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(want, xt.grad, rtol=tol, atol=tol)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x = features(batch=2, channels=2, height=6, width=5, dtype=torch.float64, device=device).requires_grad_()
    rois = torch.tensor([[0, 0.3, 0.7, 3.9, 4.6], [1, -1.2, 1.1, 6.5, 3.3]], dtype=torch.float64, device=device)
    torch.library.opcheck(torch.ops.detops.roi_align.default, (x, rois, 0.5, 2, 3, 2, True))
    torch.library.opcheck(torch.ops.detops.roi_align.default, (x.detach(), rois, 1.0, 3, 2, -1, False))
    grad = torch.randn(2, 2, 2, 3, dtype=torch.float64, device=device)
    torch.library.opcheck(
        torch.ops.detops._roi_align_backward.default, (grad, rois, 0.5, 2, 3, 2, 2, 6, 5, 2, True)
    )


def test_double_backward_raises():
    x = features(batch=1, channels=1, height=4, width=4, dtype=torch.float64).requires_grad_()
    rois = torch.tensor([[0, 0.5, 0.5, 3.0, 3.0]], dtype=torch.float64)
    out = torch.ops.detops.roi_align(x, rois, 1.0, 2, 2, 2, False)
    (g,) = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        g.sum().backward()
    out = roi_align(x, rois, 2, 1.0, 2, False)
    (g,) = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        g.sum().backward()


def test_autograd_is_cpp():
    # The op's autograd is registered in C++ (csrc/autograd): neither the forward of an input
    # that needs a gradient nor its backward runs Python of torch.library or of detops.
    x = features(batch=1, channels=2, height=6, width=6, dtype=torch.float64).requires_grad_()
    rois = torch.tensor([[0, 0.5, 0.5, 4.0, 3.0]], dtype=torch.float64)
    op = torch.ops.detops.roi_align.default
    out = []
    called = op_python_called(lambda: out.append(op(x, rois, 1.0, 2, 2, 2, False)))
    called |= op_python_called(lambda: out[0].backward(torch.ones_like(out[0])))
    assert not called, called
    xr = x.detach().clone().requires_grad_()
    ref_roi_align(xr, rois, (2, 2), 1.0, 2, False).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, **TOL[torch.float64])


def test_graph_only_where_a_gradient_is_needed():
    # A call that needs no gradient (no input requires one, or grad mode is off) records no
    # node; one whose input or RoIs require a gradient does, and the same values either way.
    x = features(batch=1, channels=2, height=6, width=6, dtype=torch.float64)
    rois = torch.tensor([[0, 0.5, 0.5, 4.0, 3.0]], dtype=torch.float64)
    plain = roi_align(x, rois, 2, 1.0, 2, False)
    assert plain.grad_fn is None and not plain.requires_grad
    xg = x.clone().requires_grad_()
    with torch.no_grad():
        off = roi_align(xg, rois, 2, 1.0, 2, False)
    assert off.grad_fn is None and not off.requires_grad
    tracked = roi_align(xg, rois, 2, 1.0, 2, False)
    assert tracked.grad_fn is not None
    by_rois = roi_align(x, rois.clone().requires_grad_(), 2, 1.0, 2, False)
    assert by_rois.grad_fn is not None
    for out in (off, tracked, by_rois):
        torch.testing.assert_close(out, plain, rtol=0, atol=0)
    with torch.inference_mode():
        torch.testing.assert_close(roi_align(xg, rois, 2, 1.0, 2, False), plain, rtol=0, atol=0)


def test_compile_fullgraph_cpu():
    torch._dynamo.reset()
    x = features(batch=2, channels=2, height=8, width=8).requires_grad_()
    rois = torch.tensor([[0, 0.3, 0.7, 5.9, 4.6], [1, -1.2, 1.1, 6.5, 3.3]])

    def f(t, r):
        return roi_align(t, r, (2, 2), 0.5, 2, True).square().sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss = compiled(x, rois)
    (g,) = torch.autograd.grad(loss, x)
    loss_e = f(x, rois)
    (g_e,) = torch.autograd.grad(loss_e, x)
    torch.testing.assert_close(loss, loss_e)
    torch.testing.assert_close(g, g_e)


def test_autocast_cpu():
    x = features(batch=2, channels=3)
    rois = edge_rois(2, 0.5, torch.float32, "cpu")
    expected = roi_align(x, rois, 3, 0.5, 2, True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = roi_align(x, rois, 3, 0.5, 2, True)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    # bfloat16 features with float32 boxes: runs in float32, returns bfloat16
    xb = x.bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = roi_align(xb, rois, 3, 0.5, 2, True)
        out_op = torch.ops.detops.roi_align(xb, rois, 0.5, 3, 3, 2, True)
    assert out.dtype == torch.bfloat16 and out_op.dtype == torch.bfloat16
    ref = roi_align(xb.detach().float(), rois, 3, 0.5, 2, True)
    torch.testing.assert_close(out.float(), ref, atol=8e-3 * max(1.0, ref.abs().max().item()), rtol=0)
    torch.testing.assert_close(out_op, out, atol=0, rtol=0)
    out.float().sum().backward()
    assert xb.grad.dtype == torch.bfloat16
    xf = xb.detach().float().requires_grad_()
    roi_align(xf, rois, 3, 0.5, 2, True).sum().backward()
    torch.testing.assert_close(xb.grad.float(), xf.grad, atol=1e-2 * max(1.0, xf.grad.abs().max().item()), rtol=0)


def test_module():
    m = RoIAlign((2, 3), spatial_scale=0.5, sampling_ratio=2, aligned=True)
    assert repr(m) == "RoIAlign(output_size=(2, 3), spatial_scale=0.5, sampling_ratio=2, aligned=True)"
    x = features()
    rois = edge_rois(2, 0.5, torch.float32, "cpu")
    torch.testing.assert_close(m(x, rois), torchvision.ops.RoIAlign((2, 3), 0.5, 2, True)(x, rois))


def test_c_entries():
    x = features()
    rois = edge_rois(2, 0.5, torch.float32, "cpu")
    out = detops._C.roi_align_forward(x, rois, 0.5, 2, 2, 2, True)
    torch.testing.assert_close(out, roi_align(x, rois, 2, 0.5, 2, True), atol=0, rtol=0)
    g = detops._C.roi_align_backward(torch.ones_like(out), rois, 0.5, 2, 2, 2, 3, 12, 10, 2, True)
    assert g.shape == x.shape


def _bad_forward_cases():
    x = features(batch=2)
    rois = torch.tensor([[0, 1.0, 1.0, 5.0, 5.0], [1, 2.0, 2.0, 6.0, 6.0]])

    def with_index(v):
        r = rois.clone()
        r[1, 0] = v
        return r

    return [
        ("input 3-D", lambda: roi_align(x[0], rois, 2), "input must be a \\[B, C, H, W\\] tensor, got \\[3, 12, 10\\]"),
        ("rois [3, 4]", lambda: roi_align(x, torch.zeros(3, 4), 2), "rois must be a \\[K, 5\\] tensor, got \\[3, 4\\]"),
        ("rois 1-D", lambda: roi_align(x, torch.zeros(5), 2), "rois must be a \\[K, 5\\] tensor, got \\[5\\]"),
        ("int rois", lambda: roi_align(x, rois.long(), 2), "rois must be a float32"),
        ("int input", lambda: roi_align(x.long(), rois, 2), "input must be a float32"),
        ("dtypes", lambda: roi_align(x, rois.double(), 2), "input and rois must have the same dtype"),
        ("pooled 0", lambda: roi_align(x, rois, (0, 2)), "pooled_height and pooled_width must be positive"),
        ("pooled -1", lambda: roi_align(x, rois, (2, -1)), "pooled_height and pooled_width must be positive"),
        ("scale 0", lambda: roi_align(x, rois, 2, 0.0), "spatial_scale must be a finite number > 0"),
        ("scale < 0", lambda: roi_align(x, rois, 2, -0.5), "spatial_scale must be a finite number > 0"),
        ("scale inf", lambda: roi_align(x, rois, 2, math.inf), "spatial_scale must be a finite number > 0"),
        ("scale nan", lambda: roi_align(x, rois, 2, math.nan), "spatial_scale must be a finite number > 0"),
        ("sampling_ratio huge", lambda: roi_align(x, rois, 2, 1.0, 1 << 20), "sampling_ratio must be at most"),
        ("index = B", lambda: roi_align(x, with_index(2.0), 2), "rois\\[1, 0\\] \\(the batch index\\) must be an integer in \\[0, 2\\)"),
        ("index < 0", lambda: roi_align(x, with_index(-1.0), 2), "the batch index\\) must be an integer"),
        ("index 0.5", lambda: roi_align(x, with_index(0.5), 2), "the batch index\\) must be an integer"),
        ("index nan", lambda: roi_align(x, with_index(math.nan), 2), "the batch index\\) must be an integer"),
        (
            "backward grad shape",
            lambda: torch.ops.detops._roi_align_backward(torch.zeros(2, 3, 2, 3), rois, 1.0, 2, 2, 2, 3, 12, 10, 2, False),
            "grad must be a \\[K, C, PH, PW\\] = \\[2, 3, 2, 2\\] tensor, got \\[2, 3, 2, 3\\]",
        ),
        (
            "backward batch index",
            lambda: torch.ops.detops._roi_align_backward(torch.zeros(2, 3, 2, 2), with_index(5.0), 1.0, 2, 2, 2, 3, 12, 10, 2, False),
            "the batch index\\) must be an integer",
        ),
        (
            "backward grad dtype",
            lambda: torch.ops.detops._roi_align_backward(torch.zeros(2, 3, 2, 2).double(), rois, 1.0, 2, 2, 2, 3, 12, 10, 2, False),
            "grad and rois must have the same dtype",
        ),
    ]


@pytest.mark.parametrize("case", _bad_forward_cases(), ids=lambda c: c[0])
def test_bad_inputs(case):
    _, call, message = case
    with pytest.raises(RuntimeError, match=message) as info:
        call()
    assert "roi_align" in str(info.value)


def test_bad_python_arguments():
    x = features()
    with pytest.raises(ValueError, match="roi_align: output_size"):
        roi_align(x, torch.zeros(1, 5), (1, 2, 3))
    with pytest.raises(ValueError, match="roi_align: boxes\\[0\\] must be a \\[L, 4\\] tensor"):
        roi_align(x, [torch.zeros(2, 5)], 2)


# --- CUDA --------------------------------------------------------------------------------------


def _many_rois(batch, n, size, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    xy = torch.rand(n, 2, generator=g) * size
    wh = torch.rand(n, 2, generator=g) * size / 2 + 1
    idx = torch.randint(0, batch, (n, 1), generator=g).float()
    return torch.cat([idx, xy, xy + wh], 1).to(dtype=dtype, device=device)


@contextlib.contextmanager
def deterministic_algorithms(mode: bool, warn_only: bool = False):
    prev, prev_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(mode, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev, warn_only=prev_warn)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("aligned,sampling_ratio", [(False, -1), (True, 2), (True, 0)])
def test_cuda_matches_cpu(dtype, deterministic, aligned, sampling_ratio):
    x = features(batch=3, channels=4, height=12, width=10, dtype=dtype)
    rois = edge_rois(2, 0.5, dtype, "cpu")
    w = torch.randn(rois.size(0), 4, 3, 2, generator=torch.Generator().manual_seed(3)).to(dtype)
    xc = x.clone().requires_grad_()
    out_cpu = roi_align(xc, rois, (3, 2), 0.5, sampling_ratio, aligned)
    (out_cpu * w).sum().backward()
    xg = x.cuda().requires_grad_()
    with deterministic_algorithms(deterministic):
        out = roi_align(xg, rois.cuda(), (3, 2), 0.5, sampling_ratio, aligned)
        (out * w.cuda()).sum().backward()
    if dtype in TOL:
        tol = TOL[dtype] if dtype == torch.float64 else dict(atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.cpu(), out_cpu, **tol)
        torch.testing.assert_close(xg.grad.cpu(), xc.grad, **tol)
    else:
        scale = max(1.0, out_cpu.abs().max().item())
        torch.testing.assert_close(out.cpu(), out_cpu, atol=2 * LOW_TOL[dtype] * scale, rtol=0)
        gscale = max(1.0, xc.grad.abs().max().item())
        torch.testing.assert_close(xg.grad.cpu().double(), xc.grad.double(), atol=4 * LOW_TOL[dtype] * gscale, rtol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("sampling_ratio", [2, -1])
def test_cuda_deterministic_backward(dtype, sampling_ratio):
    rois = _many_rois(2, 500, 320, dtype, "cuda")
    grad = torch.randn(500, 64, 7, 7, device="cuda", dtype=dtype)
    args = (rois, 1 / 8, 7, 7, 2, 64, 40, 48, sampling_ratio, True)
    with deterministic_algorithms(True):
        a = torch.ops.detops._roi_align_backward(grad, *args)
        b = torch.ops.detops._roi_align_backward(grad, *args)
    with deterministic_algorithms(False):
        c = torch.ops.detops._roi_align_backward(grad, *args)  # atomics: must not raise
    assert torch.equal(a, b)
    tol = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 1e-2}[dtype]
    torch.testing.assert_close(a.double(), c.double(), atol=tol * max(1.0, c.abs().max().item()), rtol=0)
    ref = torch.ops.detops._roi_align_backward(grad.cpu(), rois.cpu(), *args[1:])
    torch.testing.assert_close(a.cpu().double(), ref.double(), atol=tol * max(1.0, ref.abs().max().item()), rtol=0)


@pytest.mark.cuda
def test_cuda_deterministic_empty_and_warn_only():
    x = torch.randn(2, 3, 8, 8, device="cuda", requires_grad=True)
    with deterministic_algorithms(True, warn_only=True):
        roi_align(x, torch.zeros(0, 5, device="cuda"), 2).sum().backward()
        assert x.grad.abs().max() == 0
        rois = torch.tensor([[1, 0.0, 0.0, 3.0, 3.0]], device="cuda")  # image 0 has none
        x.grad = None
        roi_align(x, rois, 2, 1.0, -1, False).sum().backward()
        assert x.grad[0].abs().max() == 0 and x.grad[1].abs().max() > 0


@pytest.mark.cuda
def test_cuda_device_mismatch():
    x = features(device="cuda")
    with pytest.raises(RuntimeError, match="roi_align: input and rois must be on the same device"):
        roi_align(x, torch.tensor([[0, 1.0, 1.0, 5.0, 5.0]]), 2)


@pytest.mark.cuda
@pytest.mark.parametrize("kernel", ["gather", "band"])
def test_cuda_invalid_batch_index_asserts(kernel):
    # the band kernels check batch indices in their setup kernel, the gather kernels in a
    # kernel of their own; either way a device assertion names the op. It poisons the CUDA
    # context, so it fires in a child process.
    code = invalid_batch_index_code(kernel, "torch.ops.detops.roi_align(x, rois, 1.0, 7, 7, 2, True)")
    out = assert_fails_device_assert(code)
    assert "detops.roi_align: rois[:, 0]" in out, out


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kernel", ["gather", "band"])
def test_cuda_invalid_batch_index_asserts_backward(kernel, dtype):
    # the band backward, like the forward, checks batch indices in its setup kernel, in the
    # forward's bands (float32 here) and in bands without overlap (16-bit gradients)
    grad = f"torch.ones(51, 3, 7, 7, device='cuda', dtype=torch.{dtype})"
    call = f"torch.ops.detops._roi_align_backward({grad}, rois.to(torch.{dtype}), 1.0, 7, 7, 2, 3, 40, 40, 2, True)"
    out = assert_fails_device_assert(invalid_batch_index_code(kernel, call))
    assert "detops._roi_align_backward: rois[:, 0]" in out, out


@pytest.mark.cuda
def test_cuda_autocast():
    x = features(device="cuda")
    rois = edge_rois(2, 0.5, torch.float32, "cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        out = roi_align(x.half(), rois, 3, 0.5, 2, True)
    assert out.dtype == torch.float16
    ref = roi_align(x.half().float(), rois, 3, 0.5, 2, True)
    torch.testing.assert_close(out.float(), ref, atol=1e-3 * max(1.0, ref.abs().max().item()), rtol=0)


@pytest.mark.cuda
def test_cuda_opcheck():
    test_opcheck("cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_cuda_forward_paths_agree_with_cpu(dtype):
    # The CUDA forward picks among a channels-last vectorized kernel (channels-last input, or
    # NCHW input converted when samples outnumber its elements), an NCHW tiled kernel, and the
    # per-element kernel; RoIs with huge adaptive grids fall back inside the tiled kernels.
    from detops.testing import random_rois

    g = torch.Generator().manual_seed(0)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype in (torch.float32, torch.float64) else dict(rtol=2e-2, atol=2e-2)
    cases = [
        (torch.randn(2, 64, 40, 48, generator=g), 300, 2, True),  # converted to channels-last
        (torch.randn(2, 64, 40, 48, generator=g).to(memory_format=torch.channels_last), 20, 2, False),
        (torch.randn(2, 6, 40, 48, generator=g), 50, -1, True),  # NCHW tiled (6 channels)
        (torch.randn(1, 32, 600, 8, generator=g), 10, 0, False),  # tall RoIs: grid > tables
    ]
    for x, k, sr, aligned in cases:
        rois = random_rois(k, x.shape[0], x.shape[2], x.shape[3], seed=k, spatial_scale=0.5)
        if x.shape[2] == 600:
            rois[:, 2], rois[:, 4] = 0.0, 1200.0  # full-height RoIs: 600 / 7 -> 86 samples per bin
        xd, rd = x.to(dtype), rois.to(dtype)
        expected = roi_align(xd.float() if dtype != torch.float64 else xd, rd.float() if dtype != torch.float64 else rd, (7, 5), 0.5, sr, aligned)
        got = roi_align(xd.cuda(), rd.cuda(), (7, 5), 0.5, sr, aligned)
        assert got.is_contiguous() and got.dtype == dtype
        torch.testing.assert_close(got.cpu().to(expected.dtype), expected, **tol)


def _det_case_rois(kind, batch, k, height, width, scale, dtype, seed):
    """[k, 5] RoIs in image coordinates for the deterministic-backward cases."""
    g = torch.Generator().manual_seed(seed)
    img = torch.tensor([width, height], dtype=torch.float64) / scale
    if kind == "outside":  # corners from 1/2 of the map outside to 1/2 beyond it
        xy = torch.rand(k, 2, generator=g, dtype=torch.float64) * img * 2 - img / 2
        wh = torch.rand(k, 2, generator=g, dtype=torch.float64) * img
    else:  # sides from 1/32 to 1/2 of the image, as the benchmark
        wh = (torch.rand(k, 2, generator=g, dtype=torch.float64) * (0.5 - 1 / 32) + 1 / 32) * img
        xy = torch.rand(k, 2, generator=g, dtype=torch.float64) * (img - wh)
    if kind == "one_image":
        idx = torch.full((k, 1), float(batch - 1), dtype=torch.float64)
    else:  # batch indices in random order
        idx = torch.randint(0, batch, (k, 1), generator=g).double()
    return torch.cat([idx, xy, xy + wh], 1).to(dtype=dtype, device="cuda")


# (kind, batch, channels, height, width, rois, pooled, sampling_ratio, aligned)
DET_CASES = {
    "7x7_sr2_aligned": ("random", 2, 8, 40, 48, 300, 7, 2, True),
    "7x7_adaptive_unaligned": ("random", 3, 5, 40, 48, 120, 7, 0, False),
    "adaptive_many_samples": ("random", 2, 3, 96, 80, 40, 2, -1, True),
    "outside": ("outside", 2, 4, 30, 26, 200, 5, 2, False),
    "many_images": ("random", 7, 6, 24, 20, 150, 7, 2, True),
    "one_image": ("one_image", 3, 5, 40, 48, 200, 7, 2, True),
    # 14x14 with hundreds of RoIs in one image: 2.2 M entries in one image's lists
    "14x14_one_image": ("one_image", 2, 3, 64, 64, 700, 14, 2, True),
    # two groups of 32 channels, the second partial; planes of 1020 pixels (runs of 128, the
    # last partial)
    "37_channels": ("random", 2, 37, 30, 34, 120, 7, 2, True),
    "14x14_adaptive": ("random", 2, 9, 50, 60, 250, 14, 0, True),
}


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(DET_CASES))
def test_cuda_deterministic_backward_cases(dtype, case):
    kind, batch, channels, height, width, k, pooled, sr, aligned = DET_CASES[case]
    scale = 0.25
    rois = _det_case_rois(kind, batch, k, height, width, scale, dtype, seed=len(case))
    grad = torch.randn(k, channels, pooled, pooled, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    grad = grad.to(dtype=dtype, device="cuda")
    args = (rois, scale, pooled, pooled, batch, channels, height, width, sr, aligned)
    with deterministic_algorithms(True):
        a = torch.ops.detops._roi_align_backward(grad, *args)
        b = torch.ops.detops._roi_align_backward(grad, *args)
    assert a.shape == (batch, channels, height, width) and a.dtype == dtype and a.is_contiguous()
    assert torch.equal(a, b)
    with deterministic_algorithms(False):
        c = torch.ops.detops._roi_align_backward(grad, *args)
    ref = torch.ops.detops._roi_align_backward(grad.cpu(), rois.cpu(), *args[1:])
    tol = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    scale_ref = max(1.0, ref.abs().max().item())
    torch.testing.assert_close(a.cpu().double(), ref.double(), atol=tol * scale_ref, rtol=0)
    torch.testing.assert_close(a.double(), c.double(), atol=tol * scale_ref, rtol=0)
    if kind == "one_image":
        assert a[: batch - 1].abs().max() == 0


@pytest.mark.cuda
@pytest.mark.parametrize("sampling_ratio", [2, -1])
def test_cuda_deterministic_mode_writes_whole_buffers(sampling_ratio):
    # Under deterministic algorithms at::empty fills new memory with NaN; the forward's output
    # and the deterministic backward's buffers and grad_input skip that fill, since their
    # kernels write every element. Blocks of their sizes (the output and the transposed
    # gradient are the same size) are filled with NaN and freed first, so that the caching
    # allocator hands them out again and an element left unwritten shows.
    batch, channels, height, width, k = 3, 37, 30, 34, 120
    rois = dense_rois(batch, k, height, width, 1, 30, 0.25, seed=4, spill=0.2).float()
    rois[:, 0] = torch.where(rois[:, 0] == 1, 0.0, rois[:, 0])  # image 1 has no RoIs
    rois = rois.cuda()
    x = torch.randn(batch, channels, height, width, device="cuda")
    grad = torch.randn(k, channels, 7, 7, device="cuda")
    args = (rois, 0.25, 7, 7, batch, channels, height, width, sampling_ratio, True)
    # all held at once, so that each is a block of its own when freed
    sizes = (batch * channels * height * width, k * channels * 49, k * channels * 49, k * 49 * 4 * 4 * 2,
             k * 49 * 4 * 4, 4 * k)
    poison = [torch.full((numel,), float("nan"), device="cuda") for numel in sizes]
    del poison
    with deterministic_algorithms(True):
        out = roi_align(x, rois, 7, 0.25, sampling_ratio, True)
        gi = torch.ops.detops._roi_align_backward(grad, *args)
    assert not out.isnan().any() and not gi.isnan().any()
    torch.testing.assert_close(out, roi_align(x, rois, 7, 0.25, sampling_ratio, True), rtol=0, atol=0)
    ref = torch.ops.detops._roi_align_backward(grad.cpu(), rois.cpu(), *args[1:])
    torch.testing.assert_close(gi.cpu(), ref, atol=2e-5 * max(1.0, ref.abs().max().item()), rtol=0)
    assert gi[1].abs().max() == 0


@pytest.mark.cuda
def test_cuda_deterministic_backward_images_without_rois_and_invalid_indices():
    x = torch.randn(4, 3, 16, 16, device="cuda", requires_grad=True)
    rois = torch.tensor([[2, 1.0, 1.0, 30.0, 40.0], [0, 10.0, 5.0, 50.0, 60.0], [2, 0.0, 0.0, 64.0, 64.0]], device="cuda")
    with deterministic_algorithms(True):
        roi_align(x, rois, 7, 0.25, 2, True).sum().backward()
    assert x.grad[1].abs().max() == 0 and x.grad[3].abs().max() == 0
    xc = x.detach().cpu().requires_grad_()
    roi_align(xc, rois.cpu(), 7, 0.25, 2, True).sum().backward()
    torch.testing.assert_close(x.grad.cpu(), xc.grad, atol=1e-5, rtol=1e-5)


@contextlib.contextmanager
def deterministic_pass_limits(max_entries=0, max_channels=0, wide_keys=False):
    """Lowers the limits of one pass of the deterministic CUDA backward (0 / False: its own)."""
    previous = detops._C._set_deterministic_pass_limits(max_entries, max_channels, wide_keys)
    try:
        yield
    finally:
        detops._C._set_deterministic_pass_limits(*previous)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("case", ["37_channels", "7x7_adaptive_unaligned"])
def test_cuda_deterministic_backward_in_passes(dtype, case):
    # Inputs past one pass's limits (2^31 contributions, 65535 * 32 channels, int32 keys) run in
    # passes: over slices of the channels and with int64 keys, giving the bits of one pass, and
    # over chunks of RoIs, whose sums (in the accumulation type) are added in chunk order:
    # bit-identical from run to run and close to one pass. The limits are lowered here so that
    # small inputs take those passes.
    kind, batch, channels, height, width, k, pooled, sr, aligned = DET_CASES[case]
    scale = 0.25
    rois = _det_case_rois(kind, batch, k, height, width, scale, dtype, seed=3)
    grad = torch.randn(k, channels, pooled, pooled, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    grad = grad.to(dtype=dtype, device="cuda")
    args = (rois, scale, pooled, pooled, batch, channels, height, width, sr, aligned)

    def backward(**limits):
        with deterministic_pass_limits(**limits):
            return torch.ops.detops._roi_align_backward(grad, *args)

    with deterministic_algorithms(True):
        one = backward()
        assert torch.equal(backward(max_channels=32), one)  # two slices, the second of 5 channels
        assert torch.equal(backward(max_channels=1), one)
        assert torch.equal(backward(wide_keys=True), one)
        chunked = backward(max_entries=20000)  # several chunks of RoIs
        assert torch.equal(backward(max_entries=20000), chunked)
        assert torch.equal(backward(max_entries=20000, max_channels=32, wide_keys=True), chunked)
        assert chunked.dtype == dtype and chunked.is_contiguous()
        with pytest.raises(RuntimeError, match="at most 500 - 1 contributions .4 per sample. per RoI"):
            backward(max_entries=500)
    ref = torch.ops.detops._roi_align_backward(grad.cpu().double(), rois.cpu().double(), *args[1:])
    tol = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 4e-3}[dtype]
    scale_ref = max(1.0, ref.abs().max().item())
    torch.testing.assert_close(chunked.cpu().double(), ref, atol=tol * scale_ref, rtol=0)
    torch.testing.assert_close(chunked.double(), one.double(), atol=tol * scale_ref, rtol=0)


@pytest.mark.cuda
def test_cuda_deterministic_backward_refuses_beyond_its_limits():
    # one RoI of 2^31 bins, or of 2^31 contributions: refused with the limit named, before
    # anything is allocated for them (the gradients are expanded views)
    rois = torch.tensor([[0, 1.0, 1.0, 3.0, 3.0]], device="cuda")
    with deterministic_algorithms(True):
        grad = torch.ones(1, 1, 1, 1, device="cuda").expand(1, 1, 46341, 46341)
        with pytest.raises(RuntimeError, match=r"at most 2\^31 - 1 bins per RoI \(pooled_height \* pooled_width\)"):
            torch.ops.detops._roi_align_backward(grad, rois, 1.0, 46341, 46341, 1, 1, 4, 4, 2, True)
        grad = torch.ones(1, 1, 1, 1, device="cuda")
        with pytest.raises(RuntimeError, match=r"at most 2\^31 - 1 contributions \(4 per sample\) per RoI"):
            torch.ops.detops._roi_align_backward(grad, rois, 1.0, 1, 1, 1, 1, 4, 4, 23171, True)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_cuda_generic_kernels_for_many_bins(dtype):
    # More bins per RoI than a tiled block holds (50 x 50 > 2048): a thread per output element
    # in the forward, per gradient element in the atomic backward.
    from torch.profiler import ProfilerActivity, profile

    from detops.ops._utils import roi_kernel

    g = torch.Generator().manual_seed(2)
    # inputs rounded to dtype first, so that the float64 reference samples where the kernels do
    x = torch.randn(2, 5, 30, 40, generator=g, dtype=torch.float64).to(dtype).double()
    rois = dense_rois(2, 6, 30, 40, 4, 30, 0.5, seed=4).to(dtype).double()
    grad = torch.randn(6, 5, 50, 50, generator=g, dtype=torch.float64).to(dtype).double()
    xc = x.clone().requires_grad_()
    want = roi_align(xc, rois, 50, 0.5, 2, True)
    want.backward(grad)
    xg = x.to("cuda", dtype).requires_grad_()
    with roi_kernel("gather"), profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = roi_align(xg, rois.to("cuda", dtype), 50, 0.5, 2, True)
        out.backward(grad.to("cuda", dtype))
        torch.cuda.synchronize()
    names = " ".join(e.name for e in prof.events())
    assert "roi_align_forward_kernel" in names and "roi_align_backward_atomic_kernel" in names, names
    tol = 1e-10 if dtype == torch.float64 else 1e-5 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(out.cpu().double(), want.detach(), atol=tol * max(1.0, want.abs().max().item()), rtol=0)
    torch.testing.assert_close(xg.grad.cpu().double(), xc.grad, atol=tol * max(1.0, xc.grad.abs().max().item()), rtol=0)


# --- CUDA plane bands ------------------------------------------------------------------------


def test_roi_kernel_choice_is_checked():
    from detops.ops._utils import roi_kernel

    with pytest.raises(RuntimeError, match="kernel must be 'auto', 'band', 'gather', 'tiled' or 'generic', got 'planes'"):
        with roi_kernel("planes"):
            pass
    with roi_kernel("band"):
        with roi_kernel("gather"):
            pass
        assert detops._C._set_roi_kernel("band") == "band"
    assert detops._C._set_roi_kernel("auto") == "auto"


# (batch, channels, height, width, rois, min side, max side, spill, pooled size, sampling ratio,
#  aligned). The float32 forward stages eight channels per 32-byte pixel (the conflict-free
# kernel) on maps up to about 450 wide: 300- and 400-wide maps stage bands of 23 and 17 rows,
# with overlaps of 4 rows for 9 bin rows per RoI on 100 rows and 6 for 3x5 bins on 120 rows.
# Wider float32 maps, and the other dtypes, stage four channels per pixel (two for float64 and
# for maps of two or three channels), in bands of twice the shared memory for float32 bins as
# tall as 7x7 ones: float32 planes 600 wide stage windows of about 40 rows in the backward and
# of 21 rows (16 owned, 5 overlap) in the forward. RoIs 90 rows tall have bins taller than
# these overlaps, and RoIs up to 150 rows tall in 3x3 bins, sampled 4 x 4, have bin rows up to
# about 40 rows tall, past every window's overlap. Channel counts that are not multiples of
# four or eight leave a last, partial group. 1200 RoIs on two 64 x 64 maps give one block
# thousands of bin rows. 100 RoIs on a 64 x 200 x 304 float32 map read few samples per pixel, so
# the forward's blocks ask L2 for the bands of blocks most of a wave later (120 blocks).
BAND_CASES = {
    "few RoIs on a large map": (1, 64, 200, 304, 100, 4, 100, 0.0, (7, 7), 2, True),
    "one band": (2, 8, 40, 56, 300, 2, 30, 0.0, (7, 7), 2, True),
    "bands, tall bins": (1, 5, 100, 600, 400, 2, 90, 0.1, (7, 7), 2, True),
    "channel quads, tall bins": (1, 9, 100, 300, 400, 2, 90, 0.1, (9, 5), 2, True),
    "odd sizes": (3, 4, 97, 301, 500, 1, 97, 0.2, (14, 14), 1, False),
    "spilling RoIs": (2, 3, 120, 400, 200, 4, 200, 0.5, (3, 5), 4, False),
    "many RoIs": (2, 6, 64, 64, 1200, 1, 20, 0.0, (7, 7), 3, True),
    "taller than the window, sampling ratio 4": (2, 20, 150, 200, 300, 4, 150, 0.3, (3, 3), 4, True),
    # more bands x chunks of bin rows than the float32 forward ranks in its taps kernel: its
    # lists come from the one-block grouping instead
    "many images": (40, 8, 200, 64, 2000, 4, 100, 0.1, (7, 7), 2, True),
}


def _band_vs_gather(x, rois, pooled, scale, sr, aligned, grad):
    from detops.ops._utils import roi_kernel

    results = {}
    for kernel in ("band", "gather"):
        xg = x.clone().requires_grad_()
        with roi_kernel(kernel):
            out = roi_align(xg, rois, pooled, scale, sr, aligned)
            out.backward(grad)
        results[kernel] = (out.detach(), xg.grad)
    return results


@pytest.mark.cuda
@pytest.mark.parametrize("case", sorted(BAND_CASES))
def test_cuda_band_kernels_agree_with_gather_and_cpu(case):
    batch, c, h, w, k, lo, hi, spill, pooled, sr, aligned = BAND_CASES[case]
    scale = 0.25
    g = torch.Generator().manual_seed(len(case))
    x = torch.randn(batch, c, h, w, generator=g)
    rois = dense_rois(batch, k, h, w, lo, hi, scale, seed=k, spill=spill).float()
    grad = torch.randn(k, c, *pooled, generator=g)
    grad[::3] = 0  # zero gradients add nothing
    res = _band_vs_gather(x.cuda(), rois.cuda(), pooled, scale, sr, aligned, grad.cuda())
    (out_b, gi_b), (out_g, gi_g) = res["band"], res["gather"]
    torch.testing.assert_close(out_b, out_g, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gi_b, gi_g, rtol=1e-5, atol=1e-5)
    xc = x.clone().requires_grad_()
    out_c = roi_align(xc, rois, pooled, scale, sr, aligned)
    out_c.backward(grad)
    # the CPU kernel adds the same terms in another order
    # (coordinates of a few hundred pixels carry float32 rounding of ~3e-5 pixels into the
    # bilinear weights)
    torch.testing.assert_close(out_b.cpu(), out_c, rtol=1e-5, atol=2e-4)
    torch.testing.assert_close(gi_b.cpu(), xc.grad, rtol=1e-5, atol=2e-4)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "case",
    [
        "bands, tall bins",
        "channel quads, tall bins",
        "odd sizes",
        "many RoIs",
        "taller than the window, sampling ratio 4",
    ],
)
def test_cuda_band_kernels_dtypes(dtype, case):
    batch, c, h, w, k, lo, hi, spill, pooled, sr, aligned = BAND_CASES[case]
    scale = 0.5
    g = torch.Generator().manual_seed(7)
    x = torch.randn(batch, c, h, w, generator=g, dtype=torch.float64).to(dtype)
    rois = dense_rois(batch, k, h, w, lo, hi, scale, seed=3, spill=spill).to(dtype)
    grad = torch.randn(k, c, *pooled, generator=g, dtype=torch.float64).to(dtype)
    res = _band_vs_gather(x.cuda(), rois.cuda(), pooled, scale, sr, aligned, grad.cuda())
    (out_b, gi_b), (out_g, gi_g) = res["band"], res["gather"]
    if dtype == torch.float64:
        torch.testing.assert_close(out_b, out_g, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gi_b, gi_g, rtol=1e-12, atol=1e-12)
    else:
        # the same float32 sums rounded once: outputs agree to one rounding step
        torch.testing.assert_close(out_b.float(), out_g.float(), rtol=LOW_TOL[dtype], atol=LOW_TOL[dtype])
        gs = max(1.0, gi_g.float().abs().max().item())
        torch.testing.assert_close(gi_b.float(), gi_g.float(), rtol=0, atol=2 * LOW_TOL[dtype] * gs)


@pytest.mark.cuda
def test_cuda_band_kernels_run_when_chosen():
    # Which kernels run: under 'auto' the band backward for dense RoIs and the band forward
    # only when the maps are large as well; every band kernel under 'band'; none under
    # 'gather', for sparse RoIs under 'auto', or for the deterministic backward.
    from torch.profiler import ProfilerActivity, profile

    from detops.ops._utils import roi_kernel

    small = torch.randn(2, 16, 64, 80, device="cuda", requires_grad=True)
    large = torch.randn(2, 256, 100, 304, device="cuda", requires_grad=True)  # 62 MB
    dense_small = dense_rois(2, 400, 64, 80, 2, 40, 0.25, seed=1).float().cuda()
    dense_large = dense_rois(2, 1024, 100, 304, 2, 60, 0.25, seed=1).float().cuda()

    def kernels(kernel, x, rois):
        with roi_kernel(kernel), profile(activities=[ProfilerActivity.CUDA]) as prof:
            roi_align(x, rois, 7, 0.25, 2, True).sum().backward()
            torch.cuda.synchronize()
        return " ".join(e.name for e in prof.events())

    names = kernels("auto", large, dense_large)
    assert "band_forward" in names and "band_backward" in names
    names = kernels("auto", small, dense_small)
    assert "band_forward" not in names and "band_backward" in names
    names = kernels("band", small, dense_small[:4])
    assert "band_forward" in names and "band_backward" in names
    assert "band_" not in kernels("gather", large, dense_large)
    assert "band_" not in kernels("auto", small, dense_small[:4])
    with deterministic_algorithms(True):
        assert "band_backward" not in kernels("band", small, dense_small)  # the deterministic gather
    # float32 and 16-bit maps, which take the conflict-free band forward, take it under 'auto'
    # from about 10 MiB on; float64 maps from 48 MiB on
    mid = torch.randn(2, 32, 160, 304, device="cuda", requires_grad=True)  # 11.9 MiB
    dense_mid = dense_rois(2, 600, 160, 304, 2, 60, 0.25, seed=2).float().cuda()
    assert "band_forward_swizzled" in kernels("auto", mid, dense_mid)
    mid_half = mid.detach().half().requires_grad_()  # 5.9 MiB
    assert "band_forward" not in kernels("auto", mid_half, dense_mid.half())
    mid_bf16 = torch.randn(2, 64, 160, 304, device="cuda").bfloat16().requires_grad_()  # 11.9 MiB
    assert "band_forward_swizzled" in kernels("auto", mid_bf16, dense_mid.bfloat16())
    mid_double = torch.randn(2, 16, 160, 304, device="cuda", dtype=torch.float64, requires_grad=True)  # 11.9 MiB
    assert "band_forward" not in kernels("auto", mid_double, dense_mid.double())


@pytest.mark.cuda
def test_cuda_band_kernels_by_dtype_and_width():
    # float32 and 16-bit maps take the conflict-free band forward (eight or sixteen channels
    # per 32-byte staged pixel) where their bands hold 16 rows or more, and gradients summed in
    # float32 (float32, float16 and bfloat16 ones) the conflict-free backward there; float64
    # maps, and maps too wide for those bands, the kernels that stage fewer channels. All agree
    # with the gather kernels.
    from torch.profiler import ProfilerActivity, profile

    from detops.ops._utils import roi_kernel

    def band_kernels(x, rois, grad):
        xb = x.clone().requires_grad_()
        with roi_kernel("band"), profile(activities=[ProfilerActivity.CUDA]) as prof:
            out = roi_align(xb, rois, 7, 0.5, 2, True)
            out.backward(grad)
            torch.cuda.synchronize()
        xg = x.clone().requires_grad_()
        with roi_kernel("gather"):
            ref = roi_align(xg, rois, 7, 0.5, 2, True)
            ref.backward(grad)
        tol = 1e-5 if x.dtype in (torch.float32, torch.float64) else LOW_TOL[x.dtype]
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
        gs = max(1.0, xg.grad.float().abs().max().item())
        torch.testing.assert_close(xb.grad.float(), xg.grad.float(), rtol=tol, atol=2 * tol * gs)
        names = [e.name for e in prof.events()]
        return ({"swizzled" if "swizzled" in n else "other" for n in names if "band_forward" in n},
                {"swizzled" if "swizzled" in n else "other" for n in names if "band_backward" in n})

    # rows of 32-byte pixels a block's shared memory holds, rows padded to 2 mod 4 pixels
    optin = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    rows = lambda width: (optin - 1024) // ((width + (6 - width % 4) % 4) * 32)  # noqa: E731
    widest = max(w for w in range(4, 4096, 4) if rows(w) >= 16)  # 448 on H100 / H200
    g = torch.Generator().manual_seed(11)
    for width, dtype in [(300, torch.float32), (widest, torch.float32), (widest + 8, torch.float32),
                         (300, torch.bfloat16), (300, torch.float16), (widest, torch.float16),
                         (widest + 8, torch.bfloat16), (300, torch.float64)]:
        x = torch.randn(2, 12, 60, width, generator=g).to("cuda", dtype)
        rois = dense_rois(2, 150, 60, width, 2, 40, 0.5, seed=width).to("cuda", dtype)
        grad = torch.randn(150, 12, 7, 7, generator=g).to("cuda", dtype)
        fits = rows(width) >= 16
        forward = "swizzled" if dtype != torch.float64 and fits else "other"
        backward = "swizzled" if dtype != torch.float64 and fits else "other"
        assert band_kernels(x, rois, grad) == ({forward}, {backward}), (width, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("width", [300, 301])
def test_cuda_band_forward_staging_by_alignment(dtype, width):
    # The band forward stages rows of even width whose planes start on an 8-byte (float32) or
    # 4-byte (16-bit) boundary by pixel pairs, and other maps a pixel (float32: half a pixel)
    # per lane. Either way the staged values are the map's: the same map at an odd element
    # offset gives the same bits, and both agree with the gather kernel.
    from detops.ops._utils import roi_kernel

    g = torch.Generator().manual_seed(width)
    x = torch.randn(2, 12, 60, width, generator=g).to("cuda", dtype)
    shifted = torch.empty(x.numel() + 1, device="cuda", dtype=dtype)[1:].view_as(x)
    shifted.copy_(x)
    pair_bytes = 8 if dtype == torch.float32 else 4
    assert x.data_ptr() % pair_bytes == 0 and shifted.data_ptr() % pair_bytes != 0
    rois = dense_rois(2, 300, 60, width, 2, 40, 0.5, seed=5).to("cuda", dtype)
    with roi_kernel("band"):
        out = roi_align(x, rois, 7, 0.5, 2, True)
        out_shifted = roi_align(shifted, rois, 7, 0.5, 2, True)
    with roi_kernel("gather"):
        ref = roi_align(x, rois, 7, 0.5, 2, True)
    assert torch.equal(out, out_shifted)
    tol = 1e-5 if dtype == torch.float32 else LOW_TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "dtype, size, sliced",
    [(torch.float32, 7, True), (torch.float32, 14, False), (torch.bfloat16, 14, True), (torch.float16, 7, True)],
)
def test_cuda_band_backward_sliced_or_overlapping(dtype, size, sliced):
    # The conflict-free backward runs in bands without overlap (no tail kernel, no zeroed
    # shared rows, 16-bit gradients stored directly) for 16-bit gradients, and for float32 ones
    # where the forward's overlapping bands would share at least half their rows: 16 of 23 for
    # 7x7 bins of RoIs up to half a 200-row map, 10 of 23 for 14x14 ones. Either way it agrees
    # with the gather kernel.
    from torch.profiler import ProfilerActivity, profile

    from detops.ops._utils import roi_kernel

    g = torch.Generator().manual_seed(size)
    x = torch.randn(2, 16, 200, 304, generator=g).to("cuda", dtype)
    rois = dense_rois(2, 300, 200, 304, 4, 100, 0.25, seed=5).to("cuda", dtype)
    grad = torch.randn(300, 16, size, size, generator=g).to("cuda", dtype)
    grads = {}
    for kernel in ("band", "gather"):
        xg = x.clone().requires_grad_()
        with roi_kernel(kernel), profile(activities=[ProfilerActivity.CUDA]) as prof:
            roi_align(xg, rois, size, 0.25, 2, True).backward(grad)
            torch.cuda.synchronize()
        grads[kernel] = xg.grad
        names = " ".join(e.name for e in prof.events())
        if kernel == "band":
            assert "band_backward_swizzled" in names
            overlapping = "band_tail" in names or "zero_shared_rows" in names
            assert overlapping != sliced, names
            assert ("vectorized_elementwise" in names) == (overlapping and dtype != torch.float32), names
    tol = 1e-5 if dtype == torch.float32 else LOW_TOL[dtype]
    gs = max(1.0, grads["gather"].float().abs().max().item())
    torch.testing.assert_close(grads["band"].float(), grads["gather"].float(), rtol=tol, atol=2 * tol * gs)


@pytest.mark.cuda
def test_cuda_band_backward_more_bands_than_sliced_lists_hold():
    # A 16-bit map of more than 255 bands without overlap (4600 rows, 17 rows a band on a
    # 400-wide map) takes the overlapping bands and a float32 buffer instead (its tail kernel
    # and zeroed shared rows run); RoIs of every height, some taller than a band, some partly
    # off the map.
    from torch.profiler import ProfilerActivity, profile

    from detops.ops._utils import roi_kernel

    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 8, 4600, 400, generator=g).to("cuda", torch.float16)
    rois = dense_rois(1, 200, 4600, 400, 2, 300, 0.5, seed=9, spill=0.2).to("cuda", torch.float16)
    grad = torch.randn(200, 8, 7, 7, generator=g).to("cuda", torch.float16)
    grads = {}
    for kernel in ("band", "gather"):
        xg = x.clone().requires_grad_()
        with roi_kernel(kernel), profile(activities=[ProfilerActivity.CUDA]) as prof:
            roi_align(xg, rois, 7, 0.5, 2, True).backward(grad)
            torch.cuda.synchronize()
        grads[kernel] = xg.grad
        if kernel == "band":
            names = " ".join(e.name for e in prof.events())
            assert "band_backward_swizzled" in names and "band_tail" in names and "zero_shared_rows" in names, names
    gs = max(1.0, grads["gather"].float().abs().max().item())
    tol = LOW_TOL[torch.float16]
    torch.testing.assert_close(grads["band"].float(), grads["gather"].float(), rtol=tol, atol=2 * tol * gs)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "case", ["few RoIs on a large map", "many RoIs", "odd sizes", "many images", "dense, as benchmarked"]
)
def test_cuda_band_forward_same_bits_every_call(dtype, case):
    # The conflict-free band forward (float32 and 16-bit maps) adds a bin's terms in an order
    # set by the bin's place in its block's list: the lists are grouped in RoI order, so every
    # call gives the same bits.
    from detops.ops._utils import roi_kernel

    if case == "dense, as benchmarked":
        batch, c, h, w, k, lo, hi, spill, pooled, sr, aligned = 2, 32, 200, 304, 1024, 4, 200, 0.0, (7, 7), 2, True
    else:
        batch, c, h, w, k, lo, hi, spill, pooled, sr, aligned = BAND_CASES[case]
    g = torch.Generator().manual_seed(11)
    x = torch.randn(batch, c, h, w, generator=g).to(dtype).cuda()
    rois = dense_rois(batch, k, h, w, lo, hi, 0.25, seed=k, spill=spill).to(dtype).cuda()
    with roi_kernel("band"):
        first = roi_align(x, rois, pooled, 0.25, sr, aligned)
        for _ in range(20):
            assert torch.equal(roi_align(x, rois, pooled, 0.25, sr, aligned), first)


@pytest.mark.cuda
@pytest.mark.parametrize("case,grouping", [("many RoIs", "group_ranked"), ("many images", "group_by_owner_kernel")])
def test_cuda_band_forward_lists_grouped_as_planned(case, grouping):
    # The float32 band forward lists its bin rows from the taps kernel's ranks where chunks x
    # keys are few enough, else with the one-block grouping; both list them in order.
    from torch.profiler import ProfilerActivity, profile

    from detops.ops._utils import roi_kernel

    batch, c, h, w, k, lo, hi, spill, pooled, sr, aligned = BAND_CASES[case]
    x = torch.randn(batch, c, h, w, device="cuda")
    rois = dense_rois(batch, k, h, w, lo, hi, 0.25, seed=5, spill=spill).float().cuda()
    with roi_kernel("band"), profile(activities=[ProfilerActivity.CUDA]) as prof:
        roi_align(x, rois, pooled, 0.25, sr, aligned)
        torch.cuda.synchronize()
    names = " ".join(e.name for e in prof.events())
    assert "band_forward_swizzled" in names and grouping in names, names


@pytest.mark.cuda
@pytest.mark.parametrize("written", ["rois", "map", "gradient"])
def test_cuda_band_ops_read_what_the_kernel_before_wrote(written):
    # The band setup's first kernel is launched early and waits for the kernel before it in the
    # stream before it reads. This pins the case the early launch touches: RoIs, maps and
    # gradients written by the kernel right before the call, queued behind a busy GPU, are the
    # values the call reads. (A missing wait would show only behind a kernel that lets its
    # dependents start early; none of the kernels that precede a band call here do, so this
    # guards the results, not the wait itself.)
    from detops.ops._utils import roi_kernel

    batch, c, h, w, k, lo, hi, spill, pooled, sr, aligned = BAND_CASES["many RoIs"]
    g = torch.Generator().manual_seed(4)
    x = torch.randn(batch, c, h, w, generator=g).cuda()
    rois = dense_rois(batch, k, h, w, lo, hi, 0.25, seed=2, spill=spill).float().cuda()
    grad = torch.randn(k, c, *pooled, generator=g).cuda()
    with roi_kernel("band"):
        xg = x.clone().requires_grad_()
        expected = roi_align(xg, rois, pooled, 0.25, sr, aligned)
        expected.backward(grad)
        for _ in range(3):
            xs = x.clone() if written != "map" else torch.zeros_like(x)
            rs = rois.clone() if written != "rois" else torch.zeros_like(rois)
            gs = grad.clone() if written != "gradient" else torch.zeros_like(grad)
            torch.cuda.synchronize()
            if written == "map":
                torch.cuda._sleep(20_000_000)
                xs.add_(x)
            if written == "rois":
                torch.cuda._sleep(20_000_000)
                rs.add_(rois)
            xs.requires_grad_()
            out = roi_align(xs, rs, pooled, 0.25, sr, aligned)
            if written == "gradient":
                torch.cuda._sleep(20_000_000)
                gs.add_(grad)
            out.backward(gs)
            assert torch.equal(out, expected)
            # the backward's atomics add in whatever order they run
            torch.testing.assert_close(xs.grad, xg.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_band_kernels_read_rois_as_given(dtype):
    # The band setup reads the RoIs in their own dtype (16-bit ones with no conversion pass):
    # RoIs with a column stride give the bits of contiguous ones, forward and backward.
    from detops.ops._utils import roi_kernel

    batch, c, h, w, k, lo, hi, spill, pooled, sr, aligned = BAND_CASES["bands, tall bins"]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(batch, c, h, w, generator=g).to(dtype).cuda()
    rois = dense_rois(batch, k, h, w, lo, hi, 0.5, seed=3, spill=spill).to(dtype).cuda()
    strided = torch.cat([rois, rois], 1)[:, ::2]
    strided.copy_(rois)
    assert not strided.is_contiguous()
    grad = torch.randn(k, c, *pooled, generator=g).to(dtype).cuda()
    backward = torch.ops.detops._roi_align_backward
    with roi_kernel("band"):
        out = roi_align(x, rois, pooled, 0.5, sr, aligned)
        assert torch.equal(roi_align(x, strided, pooled, 0.5, sr, aligned), out)
        args = (0.5, *pooled, batch, c, h, w, sr, aligned)
        gi = backward(grad, rois, *args)
        # the backward adds with atomics: the last bit may differ between calls
        tol = LOW_TOL.get(dtype, 1e-5)
        torch.testing.assert_close(backward(grad, strided, *args), gi, rtol=tol, atol=tol)
    _assert_close_to_gather(out, x, rois, pooled, 0.5, sr, aligned)


@pytest.mark.cuda
def test_cuda_band_forward_more_owners_than_shared_counts():
    # 12000 images of one band each: more owners than the in-order grouping counts in shared
    # memory, so one warp lists every bin row through the scratch counts.
    from detops.ops._utils import roi_kernel

    batch = 12000
    g = torch.Generator().manual_seed(5)
    x = torch.randn(batch, 8, 16, 16, generator=g).cuda()
    xy = torch.rand(batch, 2, generator=g) * 48  # image coordinates: the maps are 1/4 of 64 x 64
    wh = 4 + torch.rand(batch, 2, generator=g) * 40
    rois = torch.cat([torch.arange(batch).float()[:, None], xy, xy + wh], 1).cuda()
    with roi_kernel("band"):
        out = roi_align(x, rois, (7, 7), 0.25, 2, True)
        assert torch.equal(roi_align(x, rois, (7, 7), 0.25, 2, True), out)
    with roi_kernel("gather"):
        ref = roi_align(x, rois, (7, 7), 0.25, 2, True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_band_forward_first_wave_without_bin_rows(dtype):
    # The band forward's first wave of blocks stages its band before the lists are ready (on
    # compute capability 9.0 and later, while the grouping runs): here every RoI lies in the
    # last of eight images, so the first wave's bands have no bin rows and the blocks that
    # have them mostly start later.
    from detops.ops._utils import roi_kernel

    x, rois = _benchmark_sized(8, 64, 400, 120, 13, dtype, rois_batch=1)
    rois[:, 0] = 7
    with roi_kernel("band"):
        out = roi_align(x, rois, (7, 7), 0.25, 2, True)
    _assert_close_to_gather(out, x, rois)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_band_forward_last_group_split(tmp_path, dtype):
    # With two waves of blocks or more, the conflict-free band forward splits each key's list
    # between the last group's block (about 5/8 of it) and one more block of the same channels
    # (a row of blocks added to the grid). The split falls on a multiple of four entries, which
    # keeps each bin's place in its block's walk: the last channels get the bits of a call of
    # their own (one group, no split). RoIs off the maps (the discard key's bin rows, which the
    # last group's first block zeroes alone) stay zeros.
    from detops.ops._utils import roi_kernel

    channels = 256
    step = 8 if dtype == torch.float32 else 16  # channels per staged pixel
    x, rois = _benchmark_sized(2, channels, 1024, 200, 19, dtype)
    off = rois[:8].clone()
    off[:, 1:] += 5000  # below and right of the maps
    rois = torch.cat([rois, off])
    with roi_kernel("band"):
        out, events = _kernel_events(lambda: roi_align(x, rois, (7, 7), 0.25, 2, True), tmp_path)
    grids = _swizzled_forward_grids(events)
    # the grid: a column per band of each image (13: rows [15 b, 15 b + 23), the last reaching
    # row 200) and one for the discard key; a row per group of channels (channels_per_block in
    # roi_align_band.cu) and one more
    def cdiv(a, b):
        return -(-a // b)

    groups = min(channels, cdiv(4 * 2 * torch.cuda.get_device_properties(0).multi_processor_count, 26))
    per_block = cdiv(cdiv(channels, groups), step) * step
    assert grids == [[2 * 13 + 1, cdiv(channels, per_block) + 1, 1]], grids
    with roi_kernel("band"):
        for lo in (0, channels - step):
            part = roi_align(x[:, lo : lo + step].contiguous(), rois, (7, 7), 0.25, 2, True)
            assert torch.equal(out[:, lo : lo + step], part)
    assert torch.equal(out[-8:], torch.zeros_like(out[-8:]))
    _assert_close_to_gather(out, x, rois)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rois, grouping", [(1024, "group_ranked_kernel"), (3000, "group_by_owner_kernel")])
def test_cuda_band_forward_last_rows_heaviest_first(tmp_path, dtype, num_rois, grouping):
    # In the last three rows of the conflict-free band forward's grid (the last two groups of
    # channels and the row the split adds), block x takes the key with the x-th longest list,
    # equal lists in key order, so that each key is taken once per row; the grouping ranks the
    # keys, in either of its kernels (3000 RoIs' chunks x keys are too many for the ranked one).
    # Here every RoI lies in image 0, above map row 100: image 1's 13 keys and image 0's lower
    # ones have empty lists (equal), the others lists of different lengths. Each group of
    # channels gets the bits of a call of its own (one group, taken in key order), and the
    # values of the gather kernels.
    from detops.ops._utils import roi_kernel

    channels = 256
    step = 8 if dtype == torch.float32 else 16  # channels per staged pixel
    x, rois = _benchmark_sized(2, channels, num_rois, 200, 23, dtype, rois_batch=1)
    rois[:, 2::2] *= 0.5
    with roi_kernel("band"):
        out, events = _kernel_events(lambda: roi_align(x, rois, (7, 7), 0.25, 2, True), tmp_path)
        grids = _swizzled_forward_grids(events)
        assert any(grouping in e.get("name", "") for e in events), grouping
        # 2 x 13 keys and the discard key; the groups of channels and the split row: the three
        # rows taken heaviest first lie past the first wave (one block an SM)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        assert len(grids) == 1 and grids[0][0] == 27 and (grids[0][1] - 3) * 27 >= sms, grids
        for lo in range(channels - 4 * step, channels, step):
            part = roi_align(x[:, lo : lo + step].contiguous(), rois, (7, 7), 0.25, 2, True)
            assert torch.equal(out[:, lo : lo + step], part), lo
        assert torch.equal(roi_align(x, rois, (7, 7), 0.25, 2, True), out)
    _assert_close_to_gather(out, x, rois)


@pytest.mark.cuda
def test_cuda_band_forward_ranked_lists_in_and_past_shared_memory(tmp_path):
    # The ranked grouping places the bin rows in shared memory and copies its lists out where
    # they fit in 64 KiB (16384 bin rows), and scatters them to global memory otherwise. Lists
    # hold their bin rows in order, so the first 1100 of 1200 RoIs take the same places in their
    # lists with 1100 RoIs (15400 bin rows at 14x14: placed in shared memory) as with 1200
    # (16800: scattered); the conflict-free forward's sums follow those places, so the bits are
    # the same, and the values are the gather kernels'.
    from detops.ops._utils import roi_kernel

    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 8, 200, 304, generator=g).cuda()
    rois = dense_rois(2, 1200, 200, 304, 1, 60, 0.25, seed=6).float().cuda()
    with roi_kernel("band"):
        out, events = _kernel_events(lambda: roi_align(x, rois, (14, 14), 0.25, 2, True), tmp_path)
        part, part_events = _kernel_events(
            lambda: roi_align(x, rois[:1100].contiguous(), (14, 14), 0.25, 2, True), tmp_path, "part"
        )
    for evs in (events, part_events):
        names = " ".join(e.get("name", "") for e in evs)
        assert "group_ranked_kernel" in names and "band_forward_swizzled" in names, names
    assert torch.equal(out[:1100], part)
    _assert_close_to_gather(out, x, rois, pooled=(14, 14))


@pytest.mark.cuda
@pytest.mark.parametrize("size, bands", [(7, 13), (14, 11)])
def test_cuda_band_last_band_holds_the_rows_past_its_core(tmp_path, size, bands):
    # On a 200-row map the float32 plan stages bands of 23 rows: 8 of them overlap at 7x7 (band
    # b holds rows [15 b, 15 b + 23)), 5 at 14x14 ([18 b, 18 b + 23)). A band whose rows would
    # all lie inside the band before it has no blocks: 13 and 11 bands an image, not 14 and 12.
    # Bin rows whose first sample row lies past the last band's core (rows 195-199 at 7x7,
    # 198-199 at 14x14) belong to the last band, which holds them whole. In the backward through
    # the overlapping bands (float32 at 14x14), the last band's rows past its core are its own:
    # stored, not added to a buffer that nothing zeroed (a block of the buffer's size is freed
    # full of NaN just before, which the caching allocator hands out again for it, best fit).
    from detops.ops._utils import roi_kernel

    g = torch.Generator().manual_seed(size)
    x = torch.randn(2, 16, 200, 304, generator=g).cuda()
    rois = dense_rois(2, 300, 200, 304, 1, 12, 0.25, seed=size).float().cuda()
    rois[:, 2] = 4 * (200 - 14 * torch.rand(300, generator=g).cuda())  # y1: the last 14 rows
    rois[:, 4] = rois[:, 2] + 4 * (0.5 + 13.5 * torch.rand(300, generator=g).cuda())  # some past the map
    grad = torch.randn(300, 16, size, size, generator=g).cuda()
    results = {}
    for kernel in ("band", "gather"):
        xg = x.clone().requires_grad_()
        torch.full((2, 16, 200, 304), float("nan"), device="cuda")  # freed at once

        def fwd_bwd():
            out = roi_align(xg, rois, size, 0.25, 2, True)
            out.backward(grad)
            return out

        with roi_kernel(kernel):
            out, events = _kernel_events(fwd_bwd, tmp_path, f"{kernel}{size}")
        results[kernel] = (out.detach(), xg.grad)
        if kernel == "band":
            grids = _swizzled_forward_grids(events)
            assert [grid[0] for grid in grids] == [2 * bands + 1], grids  # and the discard key's
            names = " ".join(e.get("name", "") for e in events)
            assert ("zero_shared_rows" in names) == (size == 14), names
    (out_b, gi_b), (out_g, gi_g) = results["band"], results["gather"]
    assert out_g.abs().sum() > 0 and gi_g[:, :, 190:].abs().sum() > 0
    torch.testing.assert_close(out_b, out_g, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gi_b, gi_g, rtol=1e-5, atol=1e-5)


def _kernel_events(fn, tmp_path, name="trace"):
    """fn()'s result and the events of its CUDA kernels (torch.profiler's chrome trace)."""
    import json

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    trace = tmp_path / f"{name}.json"
    prof.export_chrome_trace(str(trace))
    return out, json.loads(trace.read_text())["traceEvents"]


def _swizzled_forward_grids(events):
    """The grids of the conflict-free band forward's launches among a trace's events."""
    return [e["args"]["grid"] for e in events
            if "band_forward_swizzled" in e.get("name", "") and "grid" in e.get("args", {})]


def _benchmark_sized(batch, channels, k, max_side, seed, dtype, rois_batch=None):
    """CUDA maps of the benchmark's 200 x 304 size and k dense RoIs (of images
    [0, rois_batch), all by default) at scale 1/4."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, channels, 200, 304, generator=g).to(dtype).cuda()
    rois = dense_rois(rois_batch or batch, k, 200, 304, 4, max_side, 0.25, seed=seed).to(dtype).cuda()
    return x, rois


def _assert_close_to_gather(out, x, rois, pooled=(7, 7), scale=0.25, sr=2, aligned=True):
    """out (a band forward of x, rois; 7x7 at scale 1/4 by default) against the gather kernels'
    forward."""
    from detops.ops._utils import roi_kernel

    with roi_kernel("gather"):
        ref = roi_align(x, rois, pooled, scale, sr, aligned)
    tol = 1e-5 if x.dtype == torch.float32 else LOW_TOL[x.dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_band_forward_in_cuda_graph(dtype):
    # The band forward starts while the grouping before it runs (a programmatic dependent
    # launch): captured in a CUDA graph, it replays on new inputs with the bits of an eager call.
    from detops.ops._utils import roi_kernel

    x, rois = _benchmark_sized(2, 32, 600, 200, 17, dtype)
    with roi_kernel("band"):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            roi_align(x, rois, (7, 7), 0.25, 2, True)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = roi_align(x, rois, (7, 7), 0.25, 2, True)
        for seed in (1, 2):
            x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(dtype))
            rois[:, 1:].copy_(dense_rois(2, 600, 200, 304, 4, 200, 0.25, seed=seed)[:, 1:].to(dtype))
            graph.replay()
            assert torch.equal(out, roi_align(x, rois, (7, 7), 0.25, 2, True))
    _assert_close_to_gather(out, x, rois)


@pytest.mark.cuda
def test_cuda_band_kernels_images_without_rois_and_empty_bins():
    from detops.ops._utils import roi_kernel

    x = torch.randn(3, 4, 50, 70, device="cuda", requires_grad=True)
    rois = dense_rois(3, 200, 50, 70, 1, 30, 1.0, seed=5, spill=0.3).float().cuda()
    rois[:, 0] = torch.where(rois[:, 0] == 1, 0.0, rois[:, 0])  # image 1 has no RoIs
    rois[:10, 1:] = torch.tensor([500.0, 500.0, 520.0, 530.0], device="cuda")  # wholly outside
    with roi_kernel("band"):
        out = roi_align(x, rois, (7, 7), 1.0, 2, True)
        out.sum().backward()
    assert out[:10].abs().max() == 0
    assert x.grad[1].abs().max() == 0
    with roi_kernel("gather"):
        ref = roi_align(x.detach(), rois, (7, 7), 1.0, 2, True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("aligned", [True, False])
def test_cuda_band_kernels_skip_rois_off_the_map(aligned):
    # Most RoIs moved far off the map (as a sync-free multi-level pooler does): their bin rows
    # go to no band block, and the forward writes their bins as zeros itself. The memory the
    # output reuses is filled with NaN first, so a bin left unwritten shows.
    from detops.ops._utils import roi_kernel

    x = torch.randn(2, 6, 80, 120, device="cuda")
    rois = dense_rois(2, 800, 80, 120, 2, 40, 0.5, seed=9, spill=0.1).float().cuda()
    off = torch.rand(800, device="cuda") < 0.75
    rois[:, 1:] = torch.where(off[:, None], -300.0, rois[:, 1:])
    rois[5, 0] = 1.0  # an off-map RoI of the other image
    grad = torch.randn(800, 6, 7, 7, device="cuda")
    results = {}
    for kernel in ("band", "gather"):
        xg = x.clone().requires_grad_()
        poison = torch.full((800, 6, 7, 7), float("nan"), device="cuda")
        del poison
        with roi_kernel(kernel):
            out = roi_align(xg, rois, (7, 7), 0.5, 2, aligned)
            out.backward(grad)
        results[kernel] = (out.detach(), xg.grad)
    (out_b, gi_b), (out_g, gi_g) = results["band"], results["gather"]
    assert out_b[off].abs().max() == 0 and out_b[~off].abs().max() > 0
    torch.testing.assert_close(out_b, out_g, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gi_b, gi_g, rtol=1e-5, atol=1e-5)
    ref = roi_align(x.cpu(), rois.cpu(), (7, 7), 0.5, 2, aligned)
    torch.testing.assert_close(out_b.cpu(), ref, rtol=1e-5, atol=2e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backward_bands_keep_the_bits(dtype):
    # 2 x 64 planes of 40 rows: at 2 and 3 threads each thread has four chunks of planes and
    # the last of each share is cut into bands of rows, at 5 and 16 every chunk is, at 1 none
    # is. RoIs of every size, some across the map's edges, with fixed and adaptive grids: bin
    # rows wholly inside a band and rows across a band's edge. Every thread count gives the
    # one-thread bits, close to float64.
    g = torch.Generator().manual_seed(11)
    xy = torch.rand(96, 2, generator=g) * 90 - 10
    wh = torch.rand(96, 2, generator=g) * 60 + 0.5
    rois = torch.cat([torch.randint(0, 2, (96, 1), generator=g).float(), xy, xy + wh], 1).to(dtype)
    grad = torch.randn(96, 64, 5, 4, generator=g).to(dtype)
    for sampling_ratio in (2, 0):
        args = (rois, 0.5, 5, 4, 2, 64, 40, 36, sampling_ratio, True)
        want = torch.ops.detops._roi_align_backward(grad.double(), rois.double(), *args[1:])
        got = [with_threads(n, lambda: torch.ops.detops._roi_align_backward(grad, *args)) for n in (1, 2, 3, 5, 16)]
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got[0].double(), want, rtol=tol, atol=tol)
        for n, g_n in zip((2, 3, 5, 16), got[1:]):
            assert torch.equal(g_n, got[0]), f"{n} threads, sampling_ratio {sampling_ratio}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("threads", [1, 3])
def test_cpu_backward_writes_every_element(dtype, threads):
    # grad_input is allocated uninitialized and written whole by the kernel's tasks: a freed
    # tensor of the same size full of junk is handed out again by the allocator, so an element
    # left unwritten would show (image 1 has no RoIs, its planes must come back zero)
    g = torch.Generator().manual_seed(5)
    rois = torch.cat([torch.randint(0, 3, (30, 1), generator=g).float(), torch.rand(30, 2, generator=g) * 30,
                      30 + torch.rand(30, 2, generator=g) * 30], 1)
    rois[:, 0] = torch.where(rois[:, 0] == 1, 2.0, rois[:, 0])
    rois = rois.to(dtype)
    grad = torch.randn(30, 6, 3, 3, generator=g).to(dtype)
    args = (rois, 0.5, 3, 3, 3, 6, 40, 36, 2, True)
    want = torch.ops.detops._roi_align_backward(grad.double(), rois.double(), *args[1:]).to(dtype)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(3):
            junk = torch.full((3, 6, 40, 36), 1234.0, dtype=torch.float32 if dtype != torch.float64 else dtype)
            del junk
            got = torch.ops.detops._roi_align_backward(grad, *args)
            tol = {torch.float16: 1e-3, torch.float32: 1e-5, torch.float64: 1e-12}[dtype]
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
            assert got[1].abs().max() == 0
    finally:
        torch.set_num_threads(prev)


def test_cpu_backward_huge_adaptive_grid_matches_torchvision():
    # a 1200-pixel RoI with an adaptive grid has 172 x 172 samples per bin, most of them off
    # the map
    x = torch.randn(1, 2, 16, 16, dtype=torch.float64, requires_grad=True)
    rois = torch.tensor([[0.0, -600.0, -590.0, 600.0, 610.0], [0.0, 1.0, 2.0, 13.0, 11.0]], dtype=torch.float64)
    grad = torch.randn(2, 2, 7, 7, dtype=torch.float64)
    roi_align(x, rois, 7, 1.0, 0, True).backward(grad)
    xt = x.detach().clone().requires_grad_()
    torchvision.ops.roi_align(xt, rois, 7, 1.0, 0, True).backward(grad)
    torch.testing.assert_close(x.grad, xt.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_sample_tables_past_the_shared_size_match_torchvision(threads):
    # one RoI pooled to 1 x 2.2M bins: its sample table (one entry per bin column, about 70 MB
    # in float64) is past the size that the forward and backward build once and share between
    # tasks, so each task builds the tables it needs; the results are torchvision's
    pw = 2_200_000
    x = torch.randn(1, 3, 4, 8, dtype=torch.float64, requires_grad=True)
    rois = torch.tensor([[0.0, 0.5, 0.25, 7.0, 3.5]], dtype=torch.float64)
    grad = torch.randn(1, 3, 1, pw, dtype=torch.float64)
    xt = x.detach().clone().requires_grad_()
    want = torchvision.ops.roi_align(xt, rois, (1, pw), 1.0, 1, True)
    want.backward(grad)

    def run():
        out = roi_align(x, rois, (1, pw), 1.0, 1, True)
        out.backward(grad)
        return out

    out = with_threads(threads, run)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, xt.grad, rtol=1e-10, atol=1e-9)


@pytest.mark.parametrize("threads", [1, 3])
def test_cpu_outputs_past_the_huge_page_size_match_torchvision(threads):
    # every element of outputs the kernels ask huge pages for is still written
    (out, grad_x), (want, want_grad) = large_output_case(
        lambda x, rois: roi_align(x, rois, 7, 1.0, 2, True),
        lambda x, rois: torchvision.ops.roi_align(x, rois, 7, 1.0, 2, True),
        threads,
    )
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_x, want_grad, rtol=1e-5, atol=1e-5)
