#!/usr/bin/env bash
# Install (tools/install.sh), build, and run the test suite. CUDA tests are skipped when no
# GPU is visible. Extra arguments go to pytest, e.g. `bash tools/run_tests.sh -k nms`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install.sh
${PYTHON:-python3} -m pytest tests -q "$@"
