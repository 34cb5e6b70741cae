import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings

# Property-based tests (tests/test_props_*.py) run under one of two hypothesis profiles:
# "ci" (the default: few examples per test, all ops together within a few minutes on 2 cores)
# and "long" (DETOPS_HYPOTHESIS_PROFILE=long: at least 10,000 examples per op and device, run
# before a kernel change is called done). Examples are derandomized in CI so that a run is
# reproducible; the long profile draws fresh ones and prints the failing example's blob.
_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
settings.register_profile(
    "ci", max_examples=40, deadline=None, derandomize=True, print_blob=True, suppress_health_check=_SLOW_OK
)
settings.register_profile(
    "long", max_examples=10_000, deadline=None, print_blob=True, suppress_health_check=_SLOW_OK
)
settings.load_profile(os.environ.get("DETOPS_HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def cuda_param(value="cuda"):
    """A pytest.param for the CUDA variant of a device-parametrized test."""
    return pytest.param(value, marks=pytest.mark.cuda)


DEVICES = ["cpu", cuda_param()]


def dense_rois(batch, k, height, width, min_side, max_side, scale, seed, spill=0.0):
    """[k, 5] RoIs in image coordinates whose sides span min_side..max_side feature pixels,
    placed so that up to `spill` of a side lies outside the map."""
    g = torch.Generator().manual_seed(seed)
    side = min_side + torch.rand(k, 2, generator=g, dtype=torch.float64) * (max_side - min_side)
    lo = -spill * side
    span = torch.tensor([width, height], dtype=torch.float64) - (1 - 2 * spill) * side
    xy = lo + torch.rand(k, 2, generator=g, dtype=torch.float64) * span.clamp(min=0)
    idx = torch.randint(0, batch, (k, 1), generator=g).double()
    return torch.cat([idx, xy, xy + side], 1) / torch.tensor([1, scale, scale, scale, scale], dtype=torch.float64)


@pytest.fixture(scope="session")
def torch_extensions_dir(tmp_path_factory):
    """One TORCH_EXTENSIONS_DIR for the JIT builds of a test session, so each builds once."""
    return tmp_path_factory.mktemp("torch_extensions")


def invalid_batch_index_code(kernel, call):
    """Child-process code (for assert_fails_device_assert) that runs `call`, a RoI op applied to
    x ([2, 3, 40, 40]) and rois (50 dense RoIs of image 0, then one of image 5, which does not
    exist), under roi_kernel(kernel)."""
    return (
        "import torch, detops\n"
        "from detops.ops._utils import roi_kernel\n"
        "x = torch.randn(2, 3, 40, 40, device='cuda')\n"
        "rois = torch.tensor([[0.0, 0, 0, 30, 30]] * 50 + [[5.0, 0, 0, 4, 4]], device='cuda')\n"
        f"with roi_kernel('{kernel}'):\n"
        f"    {call}\n"
        "torch.cuda.synchronize()\n"
    )


def assert_fails_device_assert(code):
    """Runs `code` in a child Python in the repository root (a device-side assertion poisons
    the CUDA context of its process) and checks that it failed with one; returns the child's
    stdout and stderr together (the assertion's text goes to one or the other, depending on
    the driver)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert done.returncode != 0
    assert "assert" in done.stderr.lower(), done.stderr
    return done.stdout + done.stderr


def op_python_called(fn):
    """The source files of detops' package and of torch.library (torch/_library) whose Python
    functions fn() calls on this thread (sys.setprofile): what a call of an op with its autograd
    in C++ should not run."""
    import detops

    roots = (
        os.path.dirname(os.path.abspath(detops.__file__)) + os.sep,
        os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "_library") + os.sep,
    )
    files = set()

    def profile(frame, event, arg):
        if event == "call" and os.path.abspath(frame.f_code.co_filename).startswith(roots):
            files.add(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return files


def with_threads(n, fn):
    """fn() run with torch's CPU thread count set to n, then set back."""
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


def large_output_case(op, reference, threads, seed=4):
    """Runs op(x, rois) forward and backward with `threads` CPU threads, and reference on the
    same inputs, on a 1 x 48 x 220 x 220 map with 1024 RoIs of 2-20 pixels and 7 x 7 bins: the
    output (9.6 MB) and grad_input (9.3 MB) are past the 8 MiB from which the CPU kernels ask
    for transparent huge pages. Returns (output, grad_input) of op and of reference."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 48, 220, 220, generator=g)
    xy = torch.rand(1024, 2, generator=g) * 200
    rois = torch.cat([torch.zeros(1024, 1), xy, xy + 2 + torch.rand(1024, 2, generator=g) * 18], 1)
    grad = torch.randn(1024, 48, 7, 7, generator=g)
    results = []
    for fn, n in ((op, threads), (reference, torch.get_num_threads())):
        xg = x.clone().requires_grad_()
        out = with_threads(n, lambda: fn(xg, rois))
        with_threads(n, lambda: out.backward(grad))
        results.append((out.detach(), xg.grad))
    return results
