"""detops.jit: building the extension from csrc/ at run time, reusing it, and its locking.

The JIT module registers the detops ops, which this test process already has from detops._C,
so every JIT load runs in a child process. The build happens once per session (one shared
TORCH_EXTENSIONS_DIR): the first two children race for it, which is the concurrency test.
"""
import fcntl
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from detops import jit
from detops.testing import registered_ops

pytestmark = pytest.mark.slow

BUILD_TIMEOUT = 1500  # a cold build (CUDA kernels on a GPU machine) on few cores

CHECK = textwrap.dedent(
    """
    import json, sys, time, warnings
    {prelude}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import torch, detops, detops._C
    from detops import jit
    from detops.testing import registered_ops
    C = detops._C
    boxes = torch.tensor([[0, 0, 10, 10], [1, 1, 10, 10], [20, 20, 30, 30]], dtype=torch.float32)
    scores = torch.tensor([0.9, 0.8, 0.7])
    x = torch.arange(16, dtype=torch.float32).view(1, 1, 4, 4)
    rois = torch.tensor([[0, 0, 0, 3, 3]], dtype=torch.float32)
    out, argmax = C.roi_pool_forward(x, rois, 1.0, 2, 2)
    xg = x.clone().requires_grad_()
    detops.ops.roi_align(xg, rois, 2, 1.0, 2, True).sum().backward()
    print(json.dumps({{
        "module": C.__name__,
        "file": C.__file__,
        "torch_version": C.torch_version(),
        "with_cuda": C.with_cuda(),
        "functions": sorted(n for n in dir(C) if not n.startswith("_")),
        "ops": registered_ops(),
        "missing_kernels": [[n, k] for n in registered_ops() for k in ("CPU", "CUDA", "Meta")
                            if not torch._C._dispatch_has_kernel_for_dispatch_key("detops::" + n, k)],
        "nms": detops.ops.nms(boxes, scores, 0.5).tolist(),
        "c_nms": C.nms(boxes, scores, 0.5).tolist(),
        "roi_pool": out.flatten().tolist(),
        "roi_pool_values": detops.ops.roi_pool(x, rois, 2, 1.0).flatten().tolist(),
        "roi_align": detops.ops.roi_align(x, rois, 2, 1.0, 2, True).flatten().tolist(),
        "roi_align_grad": xg.grad.flatten().tolist(),
        "warnings": [str(w.message) for w in caught],
        "times": jit.times,
    }}))
    """
)


def _env(ext_dir, **extra):
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(ext_dir))
    env.pop("DETOPS_JIT", None)
    env.update(extra)
    return env


def _spawn(ext_dir, prelude="", **extra):
    return subprocess.Popen(
        [sys.executable, "-c", CHECK.format(prelude=prelude)],
        env=_env(ext_dir, **extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc, timeout=BUILD_TIMEOUT):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{err[-4000:]}"
    return json.loads(out.strip().splitlines()[-1]), err


def _build_dir(ext_dir):
    return os.path.join(str(ext_dir), jit._name("C", jit.want_cuda()))


def _held(path):
    """Whether some process holds an flock on path."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


@pytest.fixture(scope="session")
def jit_build(torch_extensions_dir):
    """Process A builds; process B starts while A holds the build lock and must wait for it."""
    lock = os.path.join(_build_dir(torch_extensions_dir), jit.DETOPS_LOCK)
    a = _spawn(torch_extensions_dir, DETOPS_JIT="1")
    deadline = time.monotonic() + 300
    while not _held(lock):
        assert a.poll() is None, "process A ended before it took the build lock:\n" + a.stderr.read()[-4000:]
        assert time.monotonic() < deadline, "process A never took the build lock"
        time.sleep(0.05)
    b = _spawn(torch_extensions_dir, DETOPS_JIT="1")
    a_result, a_err = _finish(a)
    b_result, b_err = _finish(b)
    return {"a": a_result, "a_err": a_err, "b": b_result, "b_err": b_err}


def test_jit_module_matches_the_prebuilt_extension(jit_build):
    import detops

    got = jit_build["a"]
    assert got["module"].startswith("detops_C_")
    assert got["torch_version"] == detops._C.torch_version()
    assert isinstance(got["with_cuda"], bool)
    prebuilt = sorted(n for n in dir(detops._C) if not n.startswith("_"))
    assert set(prebuilt) <= set(got["functions"]), set(prebuilt) - set(got["functions"])
    # the same ops as the prebuilt extension (registered_ops: the detops namespace's schemas)
    assert got["ops"] == registered_ops() and got["ops"], got["ops"]
    assert got["missing_kernels"] == [], got["missing_kernels"]
    assert got["nms"] == got["c_nms"] == [0, 2]
    assert got["roi_pool"] == got["roi_pool_values"] == [5.0, 7.0, 13.0, 15.0]
    x = torch.arange(16, dtype=torch.float32).view(1, 1, 4, 4)
    want = detops.ops.roi_align(x, torch.tensor([[0, 0, 0, 3, 3]], dtype=torch.float32), 2, 1.0, 2, True)
    assert torch.allclose(torch.tensor(got["roi_align"]), want.flatten())
    # the ops' autograd (csrc/autograd) is part of the JIT build
    xg = x.clone().requires_grad_()
    detops.ops.roi_align(xg, torch.tensor([[0, 0, 0, 3, 3]], dtype=torch.float32), 2, 1.0, 2, True).sum().backward()
    assert torch.equal(torch.tensor(got["roi_align_grad"]), xg.grad.flatten())
    assert any("DETOPS_JIT=1" in w for w in got["warnings"])


def test_concurrent_load_waits_for_the_live_build(jit_build):
    a, b = jit_build["a"], jit_build["b"]
    assert "is building in" in jit_build["b_err"] and "waiting" in jit_build["b_err"], jit_build["b_err"][-2000:]
    # B took the lock only after A's build had finished, and loaded the same library.
    assert b["times"]["locked"] >= a["times"]["built"]
    assert b["file"] == a["file"]
    assert b["nms"] == [0, 2]


def test_stale_lock_from_a_killed_build_is_removed(jit_build, torch_extensions_dir):
    build_dir = _build_dir(torch_extensions_dir)
    library = jit_build["a"]["file"]
    mtime = os.stat(library).st_mtime
    # What a build killed midway leaves: torch's lock file, and detops' lock file naming a
    # process that no longer holds it.
    with open(os.path.join(build_dir, jit.TORCH_LOCK), "w"):
        pass
    with open(os.path.join(build_dir, jit.DETOPS_LOCK), "w") as f:
        f.write("999999")
    start = time.monotonic()
    proc = _spawn(torch_extensions_dir, DETOPS_JIT="1")
    got, err = _finish(proc, timeout=240)
    assert time.monotonic() - start < 240
    assert got["nms"] == [0, 2]
    if jit.torch_lock_is_baton():
        assert "removed a stale build lock" in err
        assert not os.path.exists(os.path.join(build_dir, jit.TORCH_LOCK))
    # The existing build was reused, not recompiled.
    assert os.stat(library).st_mtime == mtime
    assert "is building in" not in err


def test_import_falls_back_to_jit_when_no_prebuilt_module(jit_build, torch_extensions_dir):
    block = textwrap.dedent(
        """
        import importlib.abc
        class _NoPrebuilt(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "detops._C":
                    raise ModuleNotFoundError("No module named 'detops._C'", name=name)
                return None
        sys.meta_path.insert(0, _NoPrebuilt())
        """
    )
    got, _ = _finish(_spawn(torch_extensions_dir, prelude=block), timeout=240)
    assert got["module"].startswith("detops_C_")
    assert any("no prebuilt detops._C was found" in w for w in got["warnings"]), got["warnings"]
    assert got["nms"] == [0, 2]


def test_clear_stale_torch_lock(tmp_path, capsys):
    lock = tmp_path / jit.TORCH_LOCK
    lock.write_text("")
    # A lock file that a live process holds with flock is not stale.
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl,sys,time; f=open(sys.argv[1]); fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)", str(lock)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert not jit.clear_stale_torch_lock(str(tmp_path), baton=True)
        assert lock.exists()
    finally:
        holder.kill()
        holder.wait()
    # Its holder is gone: with torch's O_EXCL lock file ("baton") it would block every load.
    assert jit.clear_stale_torch_lock(str(tmp_path), baton=True)
    assert not lock.exists()
    assert "removed a stale build lock" in capsys.readouterr().err
    # torch versions whose lock is an flock leave the file in place after every build: harmless.
    lock.write_text("")
    assert not jit.clear_stale_torch_lock(str(tmp_path), baton=False)
    assert lock.exists()
