"""The CPU kernels' output cache (csrc/cpu/output_cache.h): off by default; turned on with a
limit in bytes (DETOPS_CPU_OUTPUT_CACHE_MB=N MiB, N > 0, or _C._set_cpu_output_cache), outputs of
1 MiB or more take their buffers from freed outputs kept for reuse, so repeated calls do not
fault on fresh pages. A reused buffer holds the last output's values; the kernels overwrite
every element."""
import math
import os
import subprocess
import sys
import threading

import pytest
import torch

import detops
from detops import _C
from tests.conftest import with_threads

MIB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def cache():
    """The cache emptied and turned on with 256 MiB, set back afterwards."""
    previous = _C._set_cpu_output_cache(0)
    _C._set_cpu_output_cache(256 * MIB)
    yield
    _C._set_cpu_output_cache(0)
    _C._set_cpu_output_cache(previous)


def inputs(rois=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 64, 40, 60, generator=g)
    xy = torch.rand(rois, 2, generator=g) * torch.tensor([200.0, 120.0])
    wh = torch.rand(rois, 2, generator=g) * 60 + 1
    batch = torch.randint(0, 2, (rois, 1), generator=g).float()
    return x, torch.cat([batch, xy, xy + wh], 1)


def align(x, rois):
    return detops.ops.roi_align(x, rois, 7, 0.25, 2, True)


def without_cache(fn):
    previous = _C._set_cpu_output_cache(0)
    try:
        return fn()
    finally:
        _C._set_cpu_output_cache(previous)


def test_a_freed_output_is_reused_with_new_values(cache):
    x, rois = inputs()
    y = align(x, rois)  # 256 x 64 x 7 x 7 floats: 3.1 MiB
    ptr, bytes_ = y.data_ptr(), y.numel() * 4
    y.fill_(math.nan)  # a dirty buffer: the next output must overwrite all of it
    del y
    assert _C._cpu_output_cache_bytes() >= bytes_
    x2, _ = inputs(seed=1)
    y = align(x2, rois)
    assert y.data_ptr() == ptr
    assert _C._cpu_output_cache_bytes() == 0
    torch.testing.assert_close(y, without_cache(lambda: align(x2, rois)), rtol=0, atol=0)


def test_a_buffer_goes_to_an_output_at_most_an_eighth_smaller(cache):
    x, rois = inputs()
    y = align(x, rois)
    ptr = y.data_ptr()
    del y
    half = align(x, rois[:128])  # half the size: a buffer of its own
    assert half.data_ptr() != ptr
    near = align(x, rois[:240])  # 6% smaller: the kept buffer
    assert near.data_ptr() == ptr
    torch.testing.assert_close(near, without_cache(lambda: align(x, rois[:240])), rtol=0, atol=0)


def test_small_outputs_and_a_zero_limit_keep_nothing(cache):
    x, rois = inputs()
    align(x, rois[:16])  # 200 KB: torch's allocator
    assert _C._cpu_output_cache_bytes() == 0
    assert _C._set_cpu_output_cache(0) == 256 * MIB
    align(x, rois)  # with the cache off: torch's allocator
    assert _C._cpu_output_cache_bytes() == 0


def test_the_kept_bytes_stay_under_the_limit(cache):
    x, rois = inputs(rois=1024)
    _C._set_cpu_output_cache(10 * MIB)
    for n in (1024, 256, 512, 1000, 900, 300, 128):  # 12.3 MB down to 1.6 MB each
        outs = [align(x, rois[:n]) for _ in range(2)]
        del outs
        assert _C._cpu_output_cache_bytes() <= 10 * MIB
    assert _C._cpu_output_cache_bytes() > 0
    align(x, rois)  # 12.3 MB, over the limit by itself: freed at once
    assert _C._cpu_output_cache_bytes() <= 10 * MIB
    assert _C._set_cpu_output_cache(2 * MIB) == 10 * MIB  # lowering the limit gives back the rest
    assert _C._cpu_output_cache_bytes() <= 2 * MIB


def test_cached_outputs_resize_and_free_from_other_threads(cache):
    x, rois = inputs()
    y = align(x, rois)
    expected = y.clone()
    y.resize_(300, 64, 7, 7)  # a new, larger buffer from the cache's allocator; the values move
    assert torch.equal(y[:256], expected)
    storage = align(x, rois).untyped_storage()
    storage.resize_(1000)  # a buffer of less than 1 MiB from the cache's allocator
    kept = _C._cpu_output_cache_bytes()
    del storage
    assert _C._cpu_output_cache_bytes() == kept  # freed, not kept
    holder = [y]
    del y
    before = _C._cpu_output_cache_bytes()
    t = threading.Thread(target=holder.clear)
    t.start()
    t.join()
    assert _C._cpu_output_cache_bytes() >= before + 300 * 64 * 49 * 4


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("op", ["roi_align", "roi_pool"])
@pytest.mark.parametrize("channels_last", [False, True])
def test_gradients_match_without_the_cache(cache, op, channels_last, threads):
    """Forward+backward through autograd several times, gradients (channels_last ones through
    _to_channels_last's output) and outputs bit for bit against the cache turned off."""
    x, rois = inputs()
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    fn = align if op == "roi_align" else (lambda a, r: detops.ops.roi_pool(a, r, 7, 0.25))
    grad = torch.randn(256, 64, 7, 7, generator=torch.Generator().manual_seed(2))

    def run():
        leaf = x.detach().requires_grad_()
        out = with_threads(threads, lambda: fn(leaf, rois))
        with_threads(threads, lambda: out.backward(grad))
        return out.detach(), leaf.grad

    expected = without_cache(run)
    for _ in range(3):
        out, g = run()
        assert torch.equal(out, expected[0]) and torch.equal(g, expected[1])
        assert g.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        del out, g
    assert _C._cpu_output_cache_bytes() > 0


def test_deterministic_mode_outputs_are_fully_written(cache):
    """Cached outputs skip torch's NaN fill of uninitialized memory under deterministic mode:
    the kernels write every element over whatever the buffer held."""
    x, rois = inputs()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        y = align(x, rois)
        y.fill_(math.nan)
        del y
        for _ in range(2):
            out = align(x, rois)
            assert not out.isnan().any()
            out.fill_(math.inf)
            del out
    finally:
        torch.use_deterministic_algorithms(False)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def run_python(code, **env):
    full = {k: v for k, v in os.environ.items() if k != "DETOPS_CPU_OUTPUT_CACHE_MB"}
    full.update(PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    return subprocess.run([sys.executable, "-c", code], env=full, cwd=ROOT, capture_output=True, text=True)


@pytest.mark.parametrize("value, limit", [("0", 0), ("256", 256 * MIB), ("", 0), (None, 0)])
def test_the_limit_comes_from_the_environment(value, limit):
    """Off unless DETOPS_CPU_OUTPUT_CACHE_MB names a positive number of MiB."""
    code = (
        "import torch, detops; from detops import _C\n"
        "x = torch.randn(2, 64, 40, 60); r = torch.tensor([[0, 1, 1, 50, 50.]]).repeat(256, 1)\n"
        "detops.ops.roi_align(x, r, 7, 0.25, 2, True)\n"
        "print(_C._cpu_output_cache_bytes() > 0, _C._set_cpu_output_cache(0), _C._cpu_output_cache_bytes())\n"
    )
    env = {} if value is None else {"DETOPS_CPU_OUTPUT_CACHE_MB": value}
    result = run_python(code, **env)
    assert result.returncode == 0, result.stderr
    # the freed 3.2 MB output kept wherever the limit allows it, given back at 0
    assert result.stdout.split() == [str(limit > 0), str(limit), "0"]


def test_a_bad_limit_in_the_environment_names_the_variable():
    code = (
        "import torch, detops\n"
        "detops.ops.roi_align(torch.randn(2, 64, 40, 60), torch.tensor([[0, 1, 1, 50, 50.]]).repeat(256, 1), 7, 0.25)\n"
    )
    for bad in ("abc", "-1", "12MB"):
        result = run_python(code, DETOPS_CPU_OUTPUT_CACHE_MB=bad)
        assert result.returncode != 0
        assert "DETOPS_CPU_OUTPUT_CACHE_MB must be a whole number of MiB" in result.stderr, bad


def test_a_negative_limit_is_refused():
    with pytest.raises(RuntimeError, match="_set_cpu_output_cache: bytes must be >= 0"):
        _C._set_cpu_output_cache(-1)


def test_off_by_default_and_turned_on_at_run_time():
    """Without the environment variable nothing is kept; _set_cpu_output_cache turns the cache on
    (the freed output kept and its buffer reused), and 0 turns it off again."""
    code = (
        "import torch, detops; from detops import _C\n"
        "x = torch.randn(2, 64, 40, 60); r = torch.tensor([[0, 1, 1, 50, 50.]]).repeat(256, 1)\n"
        "f = lambda: detops.ops.roi_align(x, r, 7, 0.25, 2, True)\n"
        "f(); off = _C._cpu_output_cache_bytes()\n"
        "previous = _C._set_cpu_output_cache(64 << 20)\n"
        "y = f(); ptr = y.data_ptr(); del y\n"
        "kept = _C._cpu_output_cache_bytes(); reused = f().data_ptr() == ptr\n"
        "print(off, previous, kept > 0, reused, _C._set_cpu_output_cache(0), _C._cpu_output_cache_bytes())\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "0", "True", "True", str(64 * MIB), "0"]
