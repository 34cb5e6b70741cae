#!/usr/bin/env bash
# AddressSanitizer + UndefinedBehaviorSanitizer run of the C++ library on the CPU: configures
# detops with -DDETOPS_SANITIZE=ON (CUDA off) in build/sanitize, builds libdetops,
# libdetops_aot, the GoogleTest tests and the CPU driver of every op (tests/cpp/sanitize_driver.cpp),
# and runs them all through CTest. Exits non-zero on any sanitizer report, failed test or
# failed driver check. The build folder is kept, so a second run recompiles only what changed.
#
#   bash tools/sanitize_cpu.sh
#
# Environment: BUILD_DIR (default build/sanitize), MAX_JOBS (default 2), PYTHON (finds torch),
# CXX (the compiler; GCC or Clang), DETOPS_SANITIZE_QUICK=1 (the driver's --quick matrix).
# Runtime options of the sanitizers: tests/cpp/sanitizer_options.cpp (ASAN_OPTIONS and
# UBSAN_OPTIONS from the environment go on top). Flags: cmake/DetopsSanitize.cmake.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
BUILD_DIR=${BUILD_DIR:-build/sanitize}
JOBS=${MAX_JOBS:-2}
start=$SECONDS
TORCH_PREFIX=$("$PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)')
ARGS=()
if command -v nvcc >/dev/null 2>&1; then
  # torch's CMake config looks for the CUDA toolkit whenever torch is a CUDA build
  ARGS+=("-DCMAKE_CUDA_COMPILER=$(command -v nvcc)")
fi
if command -v ninja >/dev/null 2>&1 && [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then ARGS+=(-G Ninja); fi

mkdir -p "$BUILD_DIR"
echo "detops: ASan + UBSan build in $BUILD_DIR"
cmake -S . -B "$BUILD_DIR" "${ARGS[@]}" -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" \
  -DDETOPS_SANITIZE=ON -DDETOPS_WITH_CUDA=OFF -DDETOPS_BUILD_TESTS=ON \
  >"$BUILD_DIR.configure.log" 2>&1 || { cat "$BUILD_DIR.configure.log"; exit 1; }
cmake --build "$BUILD_DIR" -j "$JOBS"
built=$SECONDS

# cpp_tests (the GoogleTest tests, one process), then sanitize_driver; one at a time, as
# both run threads of their own
status=0
ctest --test-dir "$BUILD_DIR" --output-on-failure || status=1
echo "detops: sanitize build $((built - start)) s, tests and driver $((SECONDS - built)) s"
if [ "$status" != 0 ]; then
  echo "detops: ASan/UBSan run FAILED (reports above)" >&2
  exit 1
fi
echo "detops: ASan/UBSan run clean"
