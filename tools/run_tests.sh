#!/usr/bin/env bash
# Install (tools/install.sh), build, run the C++ tests (tools/cpp_tests.sh; DETOPS_SKIP_CPP=1
# skips them) and the test suite. CUDA tests are skipped when no GPU is visible. Extra
# arguments go to pytest, e.g. `bash tools/run_tests.sh -k nms`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install.sh
if [ "${DETOPS_SKIP_CPP:-0}" != "1" ]; then
  bash tools/cpp_tests.sh   # CMake build of the C++ library, its GoogleTest tests, the installed example
fi
${PYTHON:-python3} -m pytest tests -q "$@"
