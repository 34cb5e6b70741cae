"""detops._to_channels_last: a [B, C, H, W] tensor's values in a new channels_last tensor (the
layout in which roi_align's and roi_pool's autograd return a CPU channels_last input's
gradient)."""
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
    with pytest.raises(RuntimeError):
        y.sum().backward()


def test_opcheck():
    torch.library.opcheck(op, (values((2, 5, 3, 7), torch.float32),))


@pytest.mark.parametrize("device", DEVICES)
def test_devices(device):
    x = values((2, 19, 6, 45), torch.float32).to(device)
    y = op(x)
    assert y.device == x.device and y.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(y, x)
