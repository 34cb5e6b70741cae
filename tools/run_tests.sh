#!/usr/bin/env bash
# Install (tools/install.sh), build, run the C++ tests (tools/cpp_tests.sh), the C++ library's
# ASan + UBSan run (tools/sanitize_cpu.sh; DETOPS_SKIP_SANITIZE=1 skips it) and the test suite.
# DETOPS_SKIP_CPP=1 skips both C++ steps. CUDA tests are skipped when no GPU is visible. Extra
# arguments go to pytest, e.g. `bash tools/run_tests.sh -k nms`. What each step covers:
# docs/testing.md.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install.sh
if [ "${DETOPS_SKIP_CPP:-0}" != "1" ]; then
  bash tools/cpp_tests.sh   # CMake build of the C++ library, its GoogleTest tests, the installed example
  if [ "${DETOPS_SKIP_SANITIZE:-0}" != "1" ]; then
    bash tools/sanitize_cpu.sh   # the same tests and a driver of every op under ASan + UBSan (build/sanitize)
  fi
fi
${PYTHON:-python3} -m pytest tests -q "$@"
