#!/usr/bin/env bash
# The main job: install and build detops, check it against torchvision on the same inputs and
# print the comparison table (every benchmark asserts that both libraries agree before timing).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install.sh
${PYTHON:-python3} -m benchmarks.run_all "$@"
