"""Builds reuse what is built: a second `bash tools/install.sh` runs no compiler, and what decides
"unchanged" (setup.py's build_inputs_key and extension_is_current) follows every input of the
build: csrc/ (headers too), setup.py, the build environment, torch and the Python."""
import os
import re
import runpy
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# Every program a build of detops._C runs: the compilers and linker setuptools and torch's
# BuildExtension call (CC, CXX, LDSHARED default to gcc / g++ / c++), ninja, and CMake.
TOOLS = ("nvcc", "cc", "c++", "gcc", "g++", "x86_64-linux-gnu-gcc", "x86_64-linux-gnu-g++",
         "clang", "clang++", "ld", "ninja", "cmake", "make")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
CHECK = (
    "import logging, runpy, sys\n"
    "logging.getLogger('torch.utils.cpp_extension').setLevel(logging.ERROR)\n"
    "current, why = runpy.run_path('setup.py', run_name='detops_setup')['extension_is_current']()\n"
    "print(why)\n"
    "sys.exit(0 if current else 1)\n"
)


def load_setup(root=ROOT):
    return runpy.run_path(str(root / "setup.py"), run_name="detops_setup")


def shimmed_env(tmp_path):
    """An environment for tools/install.sh in which every compiler, the linker, ninja and CMake
    are scripts that log their command line to the returned log file and fail."""
    log = tmp_path / "tools.log"
    bin_dir = tmp_path / "shims" / "bin"  # doubles as CUDA_HOME/bin
    bin_dir.mkdir(parents=True)
    for name in TOOLS:
        shim = bin_dir / name
        shim.write_text(f'#!/bin/sh\necho "{name} $*" >> "{log}"\nexit 1\n')
        shim.chmod(0o755)
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env.update(CC=str(bin_dir / "cc"), CXX=str(bin_dir / "c++"), LDSHARED=f"{bin_dir / 'cc'} -shared")
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is not None:  # torch runs $CUDA_HOME/bin/nvcc, not the nvcc on PATH
        env["CUDA_HOME"] = str(bin_dir.parent)
        env.pop("CUDA_PATH", None)
    env["PYTHON"] = sys.executable
    env["DETOPS_SKIP_TORCH"] = "1"  # keep this environment's torch whatever its version
    env.pop("DETOPS_REBUILD", None)
    # tools/install.sh's default with no GPU visible, so that this check sees what it sees.
    if not env.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        env["TORCH_CUDA_ARCH_LIST"] = "9.0"
    return env, log


def logged(log):
    return log.read_text() if log.exists() else ""


def require_current_build(env):
    """Skip (fail in CI, which runs this right after tools/run_tests.sh built the extension)
    unless detops._C is built and installed from this checkout as tools/install.sh leaves it."""
    check = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, env=env, capture_output=True, text=True)
    if check.returncode != 0:
        why = (check.stdout + check.stderr).strip()
        if IN_CI:
            pytest.fail(f"detops._C is not current right after tools/install.sh: {why}")
        pytest.skip(f"detops._C is not built and installed from this checkout by tools/install.sh ({why})")


def test_second_install_runs_no_compiler(tmp_path):
    env, log = shimmed_env(tmp_path)
    require_current_build(env)
    assert logged(log) == "", "checking whether detops._C is current ran:\n" + logged(log)
    ext = Path(load_setup()["EXT_PATH"])
    before = ext.stat().st_mtime_ns

    start = time.monotonic()
    run = subprocess.run(["bash", "tools/install.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    elapsed = time.monotonic() - start

    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert logged(log) == "", "tools/install.sh ran a compiler on an unchanged checkout:\n" + logged(log)
    assert "detops: not building" in output, output
    assert ext.stat().st_mtime_ns == before
    assert elapsed < 90, f"tools/install.sh took {elapsed:.0f} s on an unchanged checkout"


@pytest.fixture
def checkout(tmp_path):
    """A copy of what goes into detops._C (csrc/ and setup.py) with setup.py's functions."""
    root = tmp_path / "checkout"
    shutil.copytree(ROOT / "csrc", root / "csrc")
    shutil.copy2(ROOT / "setup.py", root / "setup.py")
    (root / "detops").mkdir()
    return root, load_setup(root)


BUILD_ENV = ("FORCE_CUDA", "FORCE_CPU", "TORCH_CUDA_ARCH_LIST", "DETOPS_DEBUG", "DETOPS_NO_OPENMP",
             "MAX_JOBS", "DETOPS_JIT")


@pytest.fixture
def clean_env(monkeypatch):
    for name in BUILD_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_build_key_follows_sources_headers_and_setup_py(checkout, clean_env):
    root, setup = checkout
    key = setup["build_inputs_key"]
    base = key()
    assert key() == base

    header = root / "csrc" / "common" / "box_iou.h"
    text = header.read_bytes()
    os.utime(header, (time.time() + 60, time.time() + 60))
    assert key() == base, "a newer mtime with the same text is no change"
    header.write_bytes(text + b"\n")
    assert key() != base, "a changed header"
    header.write_bytes(text)
    assert key() == base

    source = root / "csrc" / "cpu" / "nms.cpp"
    text = source.read_bytes()
    source.write_bytes(text.replace(b"\n", b"\n\n", 1))
    assert key() != base, "a changed source"
    source.write_bytes(text)

    (root / "csrc" / "cuda" / "new_op.cu").write_text("// a new kernel\n")
    assert key() != base, "a new source"
    (root / "csrc" / "cuda" / "new_op.cu").unlink()

    with open(root / "setup.py", "a") as f:
        f.write("# a changed setup.py\n")
    assert key() != base, "a changed setup.py"


def test_build_key_follows_build_environment_torch_and_python(checkout, clean_env):
    _, setup = checkout
    key = setup["build_inputs_key"]
    base = key()

    clean_env.setenv("MAX_JOBS", "7")
    clean_env.setenv("DETOPS_JIT", "1")
    assert key() == base, "MAX_JOBS and DETOPS_JIT do not change what is compiled"

    settings = [("DETOPS_DEBUG", "1"), ("DETOPS_NO_OPENMP", "1")]
    if setup["want_cuda"]():  # the CUDA kernels are built: these change what nvcc compiles
        settings += [("FORCE_CPU", "1"), ("TORCH_CUDA_ARCH_LIST", "8.0"), ("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")]
        clean_env.setenv("FORCE_CUDA", "1")
        assert key() == base, "FORCE_CUDA=1 where the CUDA kernels are built anyway is the same build"
        clean_env.delenv("FORCE_CUDA")
    else:
        clean_env.setenv("TORCH_CUDA_ARCH_LIST", "8.0")
        assert key() == base, "TORCH_CUDA_ARCH_LIST does not matter to a CPU-only build"
        clean_env.delenv("TORCH_CUDA_ARCH_LIST")
    keys = {base}
    for name, value in settings:
        clean_env.setenv(name, value)
        keys.add(key())
        clean_env.delenv(name)
    assert len(keys) == len(settings) + 1, "each setting gives a key of its own"
    assert key() == base

    version = torch.__version__
    clean_env.setattr(torch, "__version__", version + ".post1")
    assert key() != base, "another torch"
    clean_env.setattr(torch, "__version__", version)
    clean_env.setattr(sys, "version", sys.version + " (another build)")
    assert key() != base, "another Python"


def test_stamp_ties_the_extension_to_its_inputs(checkout, clean_env):
    root, setup = checkout
    ext, info = Path(setup["EXT_PATH"]), Path(setup["BUILD_INFO_PATH"])
    assert ext.parent == root / "detops"
    # extension_is_current() imports detops as a script would: keep this process's sys.path.
    clean_env.setattr(sys, "path", list(sys.path))
    clean_env.setenv("DETOPS_JIT", "0")
    current = setup["extension_is_current"]

    assert current() == (False, "no record of an in-place build")
    ext.write_bytes(b"built extension")
    info.write_text("version = '0.1.0'\n")
    setup["write_stamp"](setup["build_inputs_key"]())
    ok, why = current()
    # The stamp matches; what is left is the import, which finds the installed detops, not this copy.
    assert not ok and ("import detops" in why or "detops._C" in why), why

    header = root / "csrc" / "common" / "box_iou.h"
    text = header.read_bytes()
    header.write_bytes(text + b"// changed\n")
    assert current() == (False, "sources, build flags, torch or Python changed since the last build")
    header.write_bytes(text)
    clean_env.setenv("FORCE_CPU", "1")
    assert current()[0] is False and "changed" in current()[1]
    clean_env.delenv("FORCE_CPU")

    ext.write_bytes(b"another build of the extension")
    assert "was replaced" in current()[1]
    setup["write_stamp"](setup["build_inputs_key"]())
    info.write_text("version = '0.1.0'\nwith_cuda = False\n")
    assert "_build_info.py" in current()[1]


INCLUDE = re.compile(rb'^\s*#\s*include\s*"([^"]+)"', re.M)


def test_ninja_has_nothing_to_rebuild_and_tracks_headers(tmp_path):
    """The persistent build folder of the current build: ninja finds nothing to do (a dry run), and
    each object depends on the csrc/ headers its source includes, so a changed header recompiles
    exactly the objects that include it."""
    env, _ = shimmed_env(tmp_path)
    require_current_build(env)
    ninja = shutil.which("ninja")
    setup = load_setup()
    folder = ROOT / "build" / setup["build_variant"](setup["want_cuda"]())
    if ninja is None or not (folder / "build.ninja").exists():
        pytest.fail(f"detops._C is current but {folder} holds no ninja build (is ninja installed?)")
    dry = subprocess.run([ninja, "-C", str(folder), "-n"], capture_output=True, text=True)
    assert dry.returncode == 0 and "no work to do" in dry.stdout, dry.stdout + dry.stderr

    deps = subprocess.run([ninja, "-C", str(folder), "-t", "deps"], capture_output=True, text=True, check=True)
    checked = 0
    for block in deps.stdout.strip().split("\n\n"):
        obj, *lines = block.strip().splitlines()
        files = {os.path.realpath(line.strip()) for line in lines}
        source = Path(lines[0].strip())
        assert source.is_relative_to(ROOT / "csrc"), (obj, source)
        for name in INCLUDE.findall(source.read_bytes()):
            for base in (source.parent, ROOT / "csrc"):  # "x.h" next to the source, or under -I csrc
                header = base / name.decode()
                if header.exists():
                    assert os.path.realpath(header) in files, f"{obj} does not depend on {header}"
                    checked += 1
                    break
    assert checked > 0, "no csrc/ header found among the objects' dependencies"
