#!/usr/bin/env bash
# The main job: install and build detops (tools/install.sh), then train the small Mask R-CNN
# (ResNet-18-FPN, from scratch) on the built-in shapes dataset, evaluate it with COCO metrics and
# print the AP table; pictures and the loss curve go to output/shapes_mask_rcnn_R_18_FPN/.
# Extra arguments are config overrides (KEY VALUE ...). A second run resumes from the last
# checkpoint (and, once training is complete, only evaluates again).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install.sh
${PYTHON:-python3} tools/train_net.py --config-file configs/shapes_mask_rcnn_R_18_FPN.yaml "$@"
