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
  DETOPS_NO_OPENMP=1      build without OpenMP

Builds are incremental: objects go to a persistent folder, build/temp.<platform>-<python>-torch<version>-
<cpu|cuda>[-debug], and ninja (`pip install ninja`) recompiles only the sources whose text, included
headers or compile command changed. An in-place build (`pip install -e .`, `python setup.py develop`,
`python setup.py build_ext --inplace`) records what it was built from in build/_C<suffix>.stamp;
`extension_is_current()` compares that record with the checkout, so that tools/install.sh can skip
the build altogether when nothing that goes into detops._C changed.
"""
import glob
import hashlib
import json
import os
import subprocess
import sys
import sysconfig

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


EXT_PATH = os.path.join(ROOT, "detops", "_C" + sysconfig.get_config_var("EXT_SUFFIX"))
BUILD_INFO_PATH = os.path.join(ROOT, "detops", "_build_info.py")
STAMP_PATH = os.path.join(ROOT, "build", os.path.basename(EXT_PATH) + ".stamp")


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
    text = (
        "# Written by setup.py at build time.\n"
        f"version = {VERSION!r}\n"
        f"torch_version = {torch.__version__!r}\n"
        f"torch_cuda = {torch.version.cuda if with_cuda else None!r}\n"
        f"with_cuda = {with_cuda!r}\n"
        f"cuda_arch_list = {os.environ.get('TORCH_CUDA_ARCH_LIST') if with_cuda else None!r}\n"
    )
    if read_bytes(BUILD_INFO_PATH) != text.encode():
        with open(BUILD_INFO_PATH, "w") as f:
            f.write(text)


def read_bytes(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def build_inputs_key():
    """A digest of everything that decides what detops._C is: every file under csrc/ (headers
    too), setup.py, the build environment (whether the CUDA kernels are built, which FORCE_CUDA and
    FORCE_CPU decide; DETOPS_DEBUG; DETOPS_NO_OPENMP; with CUDA, TORCH_CUDA_ARCH_LIST or, when it
    is unset, the visible GPUs), torch and the Python. MAX_JOBS is not part of it. Taken before
    setup.py fills in a default TORCH_CUDA_ARCH_LIST."""
    digest = hashlib.sha256()

    def add(*parts):
        for part in parts:
            digest.update(part if isinstance(part, bytes) else repr(part).encode())
            digest.update(b"\0")

    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, "csrc")):
        dirnames.sort()
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            add(os.path.relpath(path, ROOT), read_bytes(path) or b"")
    add("setup.py", read_bytes(os.path.join(ROOT, "setup.py")) or b"")
    with_cuda = want_cuda()
    add("with_cuda", with_cuda)
    for name in ("DETOPS_DEBUG", "DETOPS_NO_OPENMP"):
        add(name, env_flag(name))
    if with_cuda:
        archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
        add("TORCH_CUDA_ARCH_LIST", archs)
        if not archs and torch.cuda.is_available():
            add("gpus", sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}))
    add("torch", torch.__version__, torch.version.cuda, torch.version.git_version)
    add("python", sys.version, sys.implementation.cache_tag, sysconfig.get_config_var("EXT_SUFFIX"))
    return digest.hexdigest()


def file_signature(path):
    st = os.stat(path)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def write_stamp(inputs_key):
    """Record what the in-place detops._C was just built from (see extension_is_current)."""
    stamp = {
        "inputs": inputs_key,
        "extension": file_signature(EXT_PATH),
        "build_info": hashlib.sha256(read_bytes(BUILD_INFO_PATH) or b"").hexdigest(),
    }
    os.makedirs(os.path.dirname(STAMP_PATH), exist_ok=True)
    with open(STAMP_PATH + ".tmp", "w") as f:
        json.dump(stamp, f, indent=1)
    os.replace(STAMP_PATH + ".tmp", STAMP_PATH)


def extension_is_current():
    """(True, why) when detops/_C*.so was built in place from the checkout as it is now, with
    this environment and torch, and `import detops` from anywhere imports it from this checkout
    (the editable install is registered); else (False, why). Imports detops: call it from a
    process of its own (tools/install.sh does)."""
    try:
        with open(STAMP_PATH) as f:
            stamp = json.load(f)
    except (OSError, ValueError):
        return False, "no record of an in-place build"
    if stamp.get("inputs") != build_inputs_key():
        return False, "sources, build flags, torch or Python changed since the last build"
    if not os.path.exists(EXT_PATH) or stamp.get("extension") != file_signature(EXT_PATH):
        return False, f"{os.path.relpath(EXT_PATH, ROOT)} is missing or was replaced since the last build"
    if stamp.get("build_info") != hashlib.sha256(read_bytes(BUILD_INFO_PATH) or b"").hexdigest():
        return False, "detops/_build_info.py does not describe the last build"
    # Import as any script would: not from the current directory, only through the installation.
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != os.path.realpath(ROOT)]
    os.environ["DETOPS_JIT"] = "0"
    try:
        import detops
    except Exception as exc:  # noqa: BLE001 - any failure means: build again
        return False, f"import detops failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    init = os.path.join(ROOT, "detops", "__init__.py")
    if os.path.realpath(detops.__file__) != os.path.realpath(init):
        return False, f"import detops finds {os.path.dirname(detops.__file__)}, not this checkout"
    if os.path.realpath(detops._C.__file__) != os.path.realpath(EXT_PATH):
        return False, f"detops._C loads from {detops._C.__file__}"
    return True, "sources, build flags and torch unchanged since the last build"


def build_variant(with_cuda):
    """The persistent build folder's name for this Python, torch and kind of build."""
    debug = "-debug" if env_flag("DETOPS_DEBUG") else ""
    return (
        f"temp.{sysconfig.get_platform()}-{sys.implementation.cache_tag}-torch{torch.__version__}-"
        f"{'cuda' if with_cuda else 'cpu'}{debug}"
    )


class BuildExt(BuildExtension):
    """torch's BuildExtension with a persistent build folder, so that ninja rebuilds only what
    changed; an in-place build replaces detops/_C*.so by rename (a process that has the old one
    loaded keeps it intact) and writes the stamp that extension_is_current() reads."""

    inputs_key = None
    variant = None

    def finalize_options(self):
        super().finalize_options()
        # `pip install` sets a fresh temporary build_temp for every build: use ours instead.
        self.build_temp = os.path.join(ROOT, "build", self.variant)

    def run(self):
        super().run()
        if self.inplace and os.path.exists(EXT_PATH):
            write_stamp(self.inputs_key)

    def copy_file(self, infile, outfile, *args, **kwargs):
        tmp = f"{outfile}.tmp{os.getpid()}"
        _, copied = super().copy_file(infile, tmp, *args, **kwargs)
        os.replace(tmp, outfile)
        return outfile, copied


class Develop(_develop):
    """`python setup.py develop`. Recent setuptools run it as `pip install -e .` under build
    isolation, where torch is not importable: turn isolation off for that pip call (pip reads
    PIP_NO_BUILD_ISOLATION=0 as --no-build-isolation)."""

    def run(self):
        os.environ.setdefault("PIP_NO_BUILD_ISOLATION", "0")
        super().run()


def get_extensions(with_cuda):
    csrc = os.path.join("csrc")
    sources = glob.glob(os.path.join(csrc, "*.cpp")) + glob.glob(os.path.join(csrc, "cpu", "*.cpp"))
    sources += glob.glob(os.path.join(csrc, "autograd", "*.cpp"))
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
            # setuptools' own up-to-date check (used when ninja is missing) sees headers too.
            depends=sorted(
                os.path.relpath(os.path.join(d, f), ROOT)
                for d, _, files in os.walk(os.path.join(ROOT, csrc))
                for f in files
                if f.endswith((".h", ".cuh"))
            ),
            define_macros=define_macros,
            extra_compile_args=extra,
            extra_link_args=openmp,
        )
    ]


def main():
    BuildExt.inputs_key = build_inputs_key()
    with_cuda = want_cuda()
    BuildExt.variant = build_variant(with_cuda)
    setup(
        name="detops",
        version=VERSION,
        description="Detection operators for PyTorch (NMS, RoIAlign, RoIPool) in C++ and CUDA",
        long_description=open(os.path.join(ROOT, "README.md")).read() if os.path.exists(os.path.join(ROOT, "README.md")) else "",
        long_description_content_type="text/markdown",
        python_requires=">=3.9",
        packages=find_packages(exclude=("tests", "benchmarks", "tools", "configs")),
        install_requires=["torch"],
        ext_modules=get_extensions(with_cuda),
        cmdclass={"build_ext": BuildExt, "develop": Develop},
        zip_safe=False,
    )


if __name__ == "__main__":
    main()
