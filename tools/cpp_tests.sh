#!/usr/bin/env bash
# Build detops as a LibTorch C++ library with CMake, run its GoogleTest tests (CTest), install it
# to a prefix and build + run examples/cpp against the installed package (find_package(detops)).
#
#   bash tools/cpp_tests.sh
#
# Environment: DETOPS_WITH_CUDA (AUTO/ON/OFF, default OFF here: a CPU-only build check that is
# quick in CI; set AUTO or ON on a GPU machine), BUILD_DIR (default build/cmake, reused between
# runs), PREFIX (default: $BUILD_DIR/install), MAX_JOBS (default 2), PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
BUILD_DIR=${BUILD_DIR:-build/cmake}
PREFIX=${PREFIX:-$BUILD_DIR/install}
JOBS=${MAX_JOBS:-2}
TORCH_PREFIX=$("$PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)')
CUDA_ARGS=()
if command -v nvcc >/dev/null 2>&1; then
  # torch's CMake config looks for the CUDA toolkit whenever torch is a CUDA build.
  CUDA_ARGS+=("-DCMAKE_CUDA_COMPILER=$(command -v nvcc)")
fi
GENERATOR=()
if command -v ninja >/dev/null 2>&1 && [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then GENERATOR=(-G Ninja); fi

mkdir -p "$BUILD_DIR"
echo "detops: CMake build in $BUILD_DIR (DETOPS_WITH_CUDA=${DETOPS_WITH_CUDA:-OFF})"
cmake -S . -B "$BUILD_DIR" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" -DDETOPS_WITH_CUDA="${DETOPS_WITH_CUDA:-OFF}" \
  -DDETOPS_BUILD_TESTS=ON "${CUDA_ARGS[@]}" >"$BUILD_DIR.configure.log" 2>&1 \
  || { cat "$BUILD_DIR.configure.log"; exit 1; }
cmake --build "$BUILD_DIR" -j "$JOBS"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$JOBS"

rm -rf "$PREFIX"
cmake --install "$BUILD_DIR" --prefix "$PREFIX" >/dev/null
PREFIX_ABS=$(cd "$PREFIX" && pwd)
EXAMPLE_DIR="$BUILD_DIR/example"
cmake -S examples/cpp -B "$EXAMPLE_DIR" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$PREFIX_ABS;$TORCH_PREFIX" "${CUDA_ARGS[@]}" >"$EXAMPLE_DIR.configure.log" 2>&1 \
  || { cat "$EXAMPLE_DIR.configure.log"; exit 1; }
cmake --build "$EXAMPLE_DIR" -j "$JOBS"
"$EXAMPLE_DIR/detops_example"
echo "detops: C++ library, tests and installed example OK (installed at $PREFIX_ABS)"
