"""detops._to_channels_last: a [B, C, H, W] tensor's values in a new channels_last tensor (the
layout in which roi_align's and roi_pool's autograd return a channels_last input's gradient).
On CUDA an NCHW-contiguous input of 1, 2, 4 or 8-byte elements goes through a tiled transpose,
any other input through torch's copy."""
import pytest
import torch

import detops  # noqa: F401  (loads the ops)
from tests.conftest import DEVICES, with_threads

op = torch.ops.detops._to_channels_last

# one pixel; odd channel and pixel counts; one channel; one row
SHAPES = [(1, 1, 1, 1), (2, 5, 3, 7), (2, 17, 5, 33), (3, 40, 9, 131), (1, 3, 50, 41), (2, 1, 6, 6), (2, 19, 1, 70)]


def values(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    if dtype == torch.bool:
        return x > 0
    if dtype.is_complex:
        return torch.complex(x, -x).to(dtype)
    if not dtype.is_floating_point:
        return (x * 1000).to(dtype)
    return x.to(dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.bool,
              torch.complex64, torch.complex128])
def test_copies_every_value_into_channels_last(shape, dtype):
    x = values(shape, dtype)
    for threads in (1, 3):
        y = with_threads(threads, lambda: op(x))
        assert y.shape == x.shape and y.dtype == x.dtype
        assert y.is_contiguous(memory_format=torch.channels_last)
        assert y.stride() == torch.empty(shape, memory_format=torch.channels_last).stride()
        assert torch.equal(y, x)
        assert y.data_ptr() != x.data_ptr()


def test_any_input_layout():
    x = values((2, 24, 10, 12), torch.float32)
    for given in (
        x.contiguous(memory_format=torch.channels_last),  # already channels_last: a copy all the same
        x.permute(0, 1, 3, 2).contiguous().permute(0, 1, 3, 2),  # H and W swapped in memory
        values((2, 48, 10, 24), torch.float32)[:, ::2, :, ::2],  # every other channel and column
    ):
        y = op(given)
        assert y.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(y, given) and y.data_ptr() != given.data_ptr()


def test_large_map_with_several_threads():
    # a 2x64x100x152 map, split over the threads
    x = values((2, 64, 100, 152), torch.float32, seed=3)
    want = x.contiguous(memory_format=torch.channels_last)  # a copy: x has 64 channels
    for threads in (1, 2, 5):
        y = with_threads(threads, lambda: op(x))
        assert torch.equal(y, want) and y.stride() == want.stride()


@pytest.mark.parametrize("shape", [(0, 3, 4, 4), (2, 0, 4, 4), (2, 3, 0, 4), (2, 3, 4, 0)])
def test_empty(shape):
    y = op(torch.empty(shape))
    assert y.shape == shape and y.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("shape", [(3, 4, 5), (1, 2, 3, 4, 5), ()])
def test_rejects_other_than_four_dims(shape):
    with pytest.raises(RuntimeError, match=r"detops\._to_channels_last: input must be a \[B, C, H, W\] tensor"):
        op(torch.zeros(shape))


def test_no_gradient_of_its_own():
    x = values((1, 2, 3, 3), torch.float32).requires_grad_()
    y = op(x)
    with pytest.raises(RuntimeError, match=r"derivative for detops::_to_channels_last is not implemented"):
        y.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_devices(device):
    x = values((2, 19, 6, 45), torch.float32).to(device)
    y = op(x)
    assert y.device == x.device and y.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(y, x)


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.bool,
          torch.complex64, torch.complex128]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_every_value_at_its_place(dtype):
    """Square tiles of 32 values a side, or of 64 and 128 where each lane moves 2 values (4 for
    1-byte values; channels and pixels divisible by that): shapes with partial tiles on either
    axis, one of each, exactly one tile, counts divisible by 2 but not 4, one channel or one
    pixel (a plain copy); 16-byte complex128 through torch's copy."""
    extra = [(2, 32, 4, 8), (1, 33, 1, 33), (2, 64, 3, 100), (1, 300, 7, 5), (4, 3, 2, 1), (2, 130, 6, 22),
             (3, 256, 10, 30), (1, 128, 8, 16), (2, 6, 1, 2)]
    for shape in SHAPES + extra:
        x = values(shape, dtype, seed=sum(shape))
        y = op(x.cuda())
        assert y.device.type == "cuda" and y.dtype == dtype and y.shape == x.shape
        assert y.stride() == torch.empty(shape, memory_format=torch.channels_last).stride()
        assert torch.equal(y.cpu(), x)


@pytest.mark.cuda
def test_cuda_input_layouts_and_offsets():
    """An input that starts inside its storage (an image of a batch), one already channels_last,
    and strided ones (torch's copy) all give their values in a new channels_last tensor."""
    x = values((3, 40, 9, 37), torch.float32, seed=1).cuda()
    flat = values((2 * 64 * 6 * 10 + 1,), torch.float32, seed=5).cuda()
    for given in (
        x[1:],  # NCHW-contiguous, at an offset of one image
        flat[1:].view(2, 64, 6, 10),  # one value past an aligned address: a value a lane
        x[:, 5:],  # channels 5.. of each image: not contiguous
        x.contiguous(memory_format=torch.channels_last),
        x.permute(0, 1, 3, 2).contiguous().permute(0, 1, 3, 2),
        x[:, ::2, :, ::3],
    ):
        y = op(given)
        assert y.is_contiguous(memory_format=torch.channels_last) and y.data_ptr() != given.data_ptr()
        assert torch.equal(y, given)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the kernel runs on the current stream
        y = op(x[1:])
    torch.cuda.synchronize()
    assert torch.equal(y, x[1:])


@pytest.mark.cuda
def test_cuda_more_images_than_one_grid_axis():
    """More than 65535 images: the kernel's blocks loop over the images past its grid (a value a
    lane, and two)."""
    for shape in ((70000, 3, 2, 5), (70000, 4, 1, 4)):
        x = values(shape, torch.float16, seed=2).cuda()
        y = op(x)
        assert torch.equal(y, x) and y.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.cuda
def test_cuda_writes_every_element_under_deterministic_mode():
    """Under deterministic algorithms torch fills new memory with NaN; this op's output skips the
    fill, as the kernel writes every element. The allocator is first handed a block full of NaN
    of the output's size, so an element left unwritten would read NaN."""
    shape = (2, 45, 7, 11)
    x = values(shape, torch.float32, seed=4).cuda()
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for _ in range(3):
            poison = torch.full(shape, float("nan"), device="cuda")
            del poison
            y = op(x)
            assert torch.equal(y, x)
    finally:
        torch.use_deterministic_algorithms(prev)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    torch.library.opcheck(op, (values((2, 37, 3, 11), torch.float32).to(device),))
