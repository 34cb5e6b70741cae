"""Helpers shared by the Python op wrappers."""
from __future__ import annotations

import contextlib
import math
import operator
from typing import Iterator, List, Sequence, Tuple, Union

import torch
from torch import Tensor


def as_int(value, op: str, name: str) -> int:
    """`value` as an int: an int, an integer scalar (numpy, 0-dim tensor) or a float with an
    integral value; anything else (2.5, NaN, a string) is an error that names op and name, not
    a silent truncation."""
    if isinstance(value, int):
        return value
    try:
        return operator.index(value)
    except TypeError:
        pass
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{op}: {name} must be an int, got {value!r}") from None
    if not math.isfinite(v) or v != math.floor(v):
        raise ValueError(f"{op}: {name} must be an integer, got {value!r}")
    return int(v)


def as_float(value, op: str, name: str) -> float:
    """`value` as a float, with an error that names op and name for what has no float value."""
    if isinstance(value, float):
        return value
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{op}: {name} must be a number, got {value!r}") from None


def pair(size: Union[int, Sequence[int]], op: str, name: str = "output_size") -> Tuple[int, int]:
    """(h, w) from an int or a pair of ints, with a clear error for anything else."""
    if isinstance(size, int):
        return size, size
    try:
        h, w = size
    except (TypeError, ValueError):
        raise ValueError(f"{op}: {name} must be an int or a pair of ints, got {size!r}") from None
    try:
        return as_int(h, op, name), as_int(w, op, name)
    except (TypeError, ValueError):
        raise ValueError(f"{op}: {name} must be an int or a pair of ints, got {size!r}") from None


def boxes_to_rois(boxes: Union[Tensor, List[Tensor]], op: str) -> Tensor:
    """A [K, 5] (batch index, x1, y1, x2, y2) tensor from a [K, 5] tensor or a list of
    per-image [L, 4] tensors."""
    if isinstance(boxes, Tensor):
        return boxes
    if not isinstance(boxes, (list, tuple)):
        raise TypeError(f"{op}: boxes must be a Tensor[K, 5] or a list of Tensor[L, 4], got {type(boxes).__name__}")
    for i, b in enumerate(boxes):
        if not isinstance(b, Tensor) or b.dim() != 2 or b.size(1) != 4:
            shape = list(b.shape) if isinstance(b, Tensor) else type(b).__name__
            raise ValueError(f"{op}: boxes[{i}] must be a [L, 4] tensor, got {shape}")
    if len(boxes) == 0:
        raise ValueError(f"{op}: boxes is an empty list; pass one [L, 4] tensor per image")
    for i, b in enumerate(boxes):
        if b.device != boxes[0].device:
            raise ValueError(
                f"{op}: boxes[{i}] must be on the device of boxes[0], got {b.device} and {boxes[0].device}"
            )
    cat = torch.cat(list(boxes), dim=0)
    idx = torch.cat(
        [torch.full((b.size(0), 1), i, dtype=cat.dtype, device=cat.device) for i, b in enumerate(boxes)],
        dim=0,
    )
    return torch.cat([idx, cat], dim=1)


@contextlib.contextmanager
def roi_kernel(name: str) -> Iterator[None]:
    """Within the block, roi_align and roi_pool on CUDA use the chosen kernels: 'auto' (the
    default: shared-memory kernels for dense RoIs, global gathers otherwise), 'band' (the
    shared-memory kernels whenever the shapes allow) or 'gather' (never them); 'tiled' and
    'generic' force one of roi_align's gathers, forward and backward: the tiled kernels (a
    block per RoI and run of channels, any input layout) where they can take the shapes, else
    the 'auto' choice, and the generic ones (a thread per element) always. roi_pool has no
    tiled or generic kernels and chooses as under 'auto' for those two. The shared-memory
    kernels are plane bands for NCHW input (roi_align, and roi_pool's backward) and channel
    tiles for any layout (roi_pool's forward). The deterministic backwards
    (torch.use_deterministic_algorithms) are chosen whatever the setting. Process-wide; for
    benchmarks and tests that compare the kernels."""
    from detops import _C

    previous = _C._set_roi_kernel(name)
    try:
        yield
    finally:
        _C._set_roi_kernel(previous)


@contextlib.contextmanager
def cpu_vector(name: str) -> Iterator[None]:
    """Within the block, the CPU roi_pool forward on float32 input uses the chosen instructions:
    'auto' (the default: AVX2 where the CPU has it, with AVX-512VL's mask registers for the
    argmax on Intel CPUs that have them, else SSE2 on x86-64, else scalar code), 'avx512'
    (AVX2, with the masks for the argmax on any CPU that has them), 'avx2' (no AVX-512), 'sse2'
    or 'scalar'.
    A choice the CPU lacks falls back to the next narrower one. Process-wide; for benchmarks
    and tests that compare the paths, which give the same bits."""
    from detops import _C

    previous = _C._set_cpu_vector(name)
    try:
        yield
    finally:
        _C._set_cpu_vector(previous)


@contextlib.contextmanager
def nms_kernel(rank: str = "auto", pass_: str = "auto") -> Iterator[None]:
    """Within the block, nms, batched_nms and nms_padded on CUDA use the chosen kernels.
    `rank`, how boxes are ranked by score: 'auto' (the default: counting for up to 8192 boxes
    whose scores have the boxes' dtype, not float64; else a radix sort of the scores, or torch's
    sort for float64 scores), 'count', 'radix' (nms and batched_nms only) or 'sort' (torch's
    stable sort). `pass_`, nms's greedy pass: 'auto' (one block for nms up to 4096 boxes, the
    cooperative dataflow kernel otherwise), 'block' or 'dataflow'. A choice the input cannot take
    falls back to the automatic one. Process-wide; for benchmarks and tests that compare the
    kernels, which give the same indices. The CPU kernels ignore it."""
    from detops import _C

    previous = _C._set_nms_kernel(rank, pass_)
    try:
        yield
    finally:
        _C._set_nms_kernel(*previous)
