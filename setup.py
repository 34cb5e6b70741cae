"""Build detops and its one compiled extension, detops._C.

The extension is a CUDAExtension when torch has CUDA and nvcc is found (or FORCE_CUDA=1), else a
CppExtension; FORCE_CPU=1 builds the CPU kernels only. torch must be installed first, and the
build must see it: use `pip install -e . --no-build-isolation` or `python setup.py develop`.

Environment:
  FORCE_CUDA=1            build the CUDA kernels even with no GPU visible (nvcc still needed)
  FORCE_CPU=1             build without CUDA kernels
  TORCH_CUDA_ARCH_LIST    GPU architectures, e.g. "9.0" or "8.0;9.0+PTX"; when unset and no GPU
                          is visible, a default set that this nvcc supports is used
  MAX_JOBS                parallel compile jobs
  DETOPS_DEBUG=1          -O0 -g host code, -G -lineinfo device code
"""
import glob
import os
import subprocess
import sys

from setuptools import find_packages, setup
from setuptools.command.develop import develop as _develop

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
except ImportError:  # pragma: no cover - explained to the user
    sys.exit(
        "detops: torch must be installed before building detops, and the build must see it.\n"
        "  pip install torch torchvision\n"
        "  pip install -e . --no-build-isolation"
    )

ROOT = os.path.dirname(os.path.abspath(__file__))
VERSION = "0.1.0"
# Architectures built when no GPU is visible to pick from (datacenter and consumer GPUs from
# Turing on; CUDA 13 dropped the older ones). Filtered by what this nvcc can target.
DEFAULT_ARCHS = ["7.5", "8.0", "8.6", "8.9", "9.0"]


def env_flag(name):
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


def nvcc_arches():
    """Compute capabilities this nvcc can compile for, e.g. {'7.5', '9.0'}; empty if unknown."""
    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else "nvcc"
    try:
        out = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return set()
    arches = set()
    for line in out.split():
        if line.startswith("compute_"):
            digits = "".join(ch for ch in line[len("compute_"):] if ch.isdigit())
            if len(digits) >= 2:
                arches.add(f"{digits[:-1]}.{digits[-1]}")
    return arches


def want_cuda():
    if env_flag("FORCE_CPU"):
        return False
    if env_flag("FORCE_CUDA"):
        if CUDA_HOME is None:
            sys.exit("detops: FORCE_CUDA=1 but no CUDA toolkit was found (set CUDA_HOME or put nvcc on PATH)")
        if torch.version.cuda is None:
            sys.exit(f"detops: FORCE_CUDA=1 but torch {torch.__version__} is a CPU-only build")
        return True
    return torch.version.cuda is not None and CUDA_HOME is not None


def set_default_arch_list():
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return
    if torch.cuda.is_available():
        return  # torch builds for the visible GPUs
    supported = nvcc_arches()
    archs = [a for a in DEFAULT_ARCHS if not supported or a in supported] or DEFAULT_ARCHS[-1:]
    archs[-1] += "+PTX"
    os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(archs)
    print(f"detops: no GPU visible, building for TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}")


def write_build_info(with_cuda):
    path = os.path.join(ROOT, "detops", "_build_info.py")
    with open(path, "w") as f:
        f.write("# Written by setup.py at build time.\n")
        f.write(f"version = {VERSION!r}\n")
        f.write(f"torch_version = {torch.__version__!r}\n")
        f.write(f"torch_cuda = {torch.version.cuda if with_cuda else None!r}\n")
        f.write(f"with_cuda = {with_cuda!r}\n")
        f.write(f"cuda_arch_list = {os.environ.get('TORCH_CUDA_ARCH_LIST') if with_cuda else None!r}\n")


class Develop(_develop):
    """`python setup.py develop`. Recent setuptools run it as `pip install -e .` under build
    isolation, where torch is not importable: turn isolation off for that pip call (pip reads
    PIP_NO_BUILD_ISOLATION=0 as --no-build-isolation)."""

    def run(self):
        os.environ.setdefault("PIP_NO_BUILD_ISOLATION", "0")
        super().run()


def get_extensions():
    with_cuda = want_cuda()
    csrc = os.path.join("csrc")
    sources = glob.glob(os.path.join(csrc, "*.cpp")) + glob.glob(os.path.join(csrc, "cpu", "*.cpp"))
    sources += glob.glob(os.path.join(csrc, "autocast", "*.cpp")) + glob.glob(os.path.join(csrc, "autograd", "*.cpp"))
    debug = env_flag("DETOPS_DEBUG")
    cxx = ["-O0", "-g"] if debug else ["-O3"]
    # at::parallel_for is an inline OpenMP template: without -fopenmp it runs on one thread.
    openmp = (
        ["-fopenmp"]
        if sys.platform.startswith("linux")
        and "OpenMP" in torch.__config__.parallel_info()
        and not env_flag("DETOPS_NO_OPENMP")
        else []
    )
    cxx += openmp
    define_macros = [("DETOPS_WITH_PYTHON", None)]
    extra = {"cxx": cxx}
    if with_cuda:
        set_default_arch_list()
        sources += glob.glob(os.path.join(csrc, "cuda", "*.cu"))
        sources += glob.glob(os.path.join(csrc, "cuda", "*.cpp"))
        define_macros.append(("WITH_CUDA", None))
        extra["nvcc"] = ["-G", "-lineinfo"] if debug else ["-O3", "-lineinfo"]
        extra["nvcc"] += ["--expt-relaxed-constexpr", "-DWITH_CUDA"]
        ext_cls = CUDAExtension
    else:
        ext_cls = CppExtension
    write_build_info(with_cuda)
    print(f"detops: building {'CUDA' if with_cuda else 'CPU-only'} extension against torch {torch.__version__}")
    return [
        ext_cls(
            "detops._C",
            sorted(sources),
            include_dirs=[os.path.join(ROOT, csrc)],
            define_macros=define_macros,
            extra_compile_args=extra,
            extra_link_args=openmp,
        )
    ]


setup(
    name="detops",
    version=VERSION,
    description="Detection operators for PyTorch (NMS, RoIAlign, RoIPool) in C++ and CUDA",
    long_description=open(os.path.join(ROOT, "README.md")).read() if os.path.exists(os.path.join(ROOT, "README.md")) else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(exclude=("tests", "benchmarks", "tools", "configs")),
    install_requires=["torch"],
    ext_modules=get_extensions(),
    cmdclass={"build_ext": BuildExtension, "develop": Develop},
    zip_safe=False,
)
