#!/usr/bin/env bash
# Install detops and what it needs into the current Python environment, then build detops._C.
#
#   bash tools/install.sh
#
# Installs the tested torch / torchvision pair (override with TORCH_SPEC / TORCHVISION_SPEC, or
# set DETOPS_SKIP_TORCH=1 to keep the torch you have), the test and tool dependencies, and
# builds the extension in place with `pip install -e . --no-build-isolation`. The CUDA kernels
# are compiled whenever torch has CUDA and nvcc is found. With no GPU visible and no
# TORCH_CUDA_ARCH_LIST set, they are compiled for sm_90 only (a build check; set
# TORCH_CUDA_ARCH_LIST to target your GPUs).
#
# A run that finds detops._C built in place from the same csrc/ files, setup.py, build
# environment (CUDA kernels or not, as FORCE_CUDA / FORCE_CPU decide; TORCH_CUDA_ARCH_LIST;
# DETOPS_DEBUG; DETOPS_NO_OPENMP; not MAX_JOBS), torch and Python, and installed from this
# checkout, does not build (setup.py's extension_is_current()). Otherwise the build is incremental: ninja recompiles only what changed,
# in build/temp.*. DETOPS_REBUILD=1 builds regardless (still incremental); deleting build/ starts
# from nothing. The full build log is in build/install.log.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.14.1}
TORCHVISION_SPEC=${TORCHVISION_SPEC:-torchvision==0.29.2}

pip_install() { "$PYTHON" -m pip install --disable-pip-version-check -q "$@"; }

if [ "${DETOPS_SKIP_TORCH:-0}" != "1" ]; then
  if ! "$PYTHON" - "$TORCH_SPEC" "$TORCHVISION_SPEC" <<'PY' 2>/dev/null; then
import sys, torch, torchvision
want = {a.split("==")[0]: a.split("==")[1] for a in sys.argv[1:] if "==" in a}
have = {"torch": torch.__version__.split("+")[0], "torchvision": torchvision.__version__.split("+")[0]}
sys.exit(0 if all(have.get(k) == v for k, v in want.items()) else 1)
PY
    echo "detops: installing $TORCH_SPEC $TORCHVISION_SPEC"
    pip_install "$TORCH_SPEC" "$TORCHVISION_SPEC"
  fi
fi
pip_install "setuptools>=64" wheel ninja numpy pytest hypothesis pyyaml yacs pycocotools matplotlib pillow

# The C++ build (tools/cpp_tests.sh) needs CMake and GoogleTest. CMake comes from pip when the
# system has none; GoogleTest from the system packages (needs root and apt-get).
if ! command -v cmake >/dev/null 2>&1; then
  pip_install cmake
fi
have_gtest() {
  local f
  for f in /usr/lib/*/cmake/GTest/GTestConfig.cmake /usr/lib/cmake/GTest/GTestConfig.cmake \
      /usr/local/lib/cmake/GTest/GTestConfig.cmake /usr/local/lib/*/cmake/GTest/GTestConfig.cmake; do
    [ -f "$f" ] && return 0
  done
  return 1
}
if ! have_gtest; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "detops: installing GoogleTest (libgtest-dev) for the C++ tests"
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libgtest-dev >/dev/null
  else
    echo "detops: GoogleTest not found; install libgtest-dev (or set GTest_DIR) to run the C++ tests" >&2
  fi
fi

if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ] && ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  export TORCH_CUDA_ARCH_LIST="9.0"
fi
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
if [ "${DETOPS_REBUILD:-0}" != "1" ] && "$PYTHON" - <<'PY'; then
import logging, runpy, sys
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # no CUDA_HOME notice
current, why = runpy.run_path("setup.py", run_name="detops_setup")["extension_is_current"]()
if not current:
    print(f"detops: build needed: {why}")
    sys.exit(1)
import detops
print(f"detops: not building, {why}")
print("detops", detops.__version__, "built with CUDA:", detops._C.with_cuda())
PY
  exit 0
fi
echo "detops: building (TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-visible GPUs}, MAX_JOBS=$MAX_JOBS; log: build/install.log)"
mkdir -p build
if ! "$PYTHON" -m pip install -v --disable-pip-version-check --no-build-isolation -e . >build/install.log 2>&1; then
  tail -n 40 build/install.log
  echo "detops: the build failed; full log: build/install.log" >&2
  exit 1
fi
tail -n 2 build/install.log
"$PYTHON" -c "import detops; print('detops', detops.__version__, 'built with CUDA:', detops._C.with_cuda())"
