#!/usr/bin/env bash
# One call on a GPU machine: build for sm_90, run the whole test suite (CUDA tests included),
# then every benchmark on CUDA and CPU (benchmarks.md) and what each CUDA speed mechanism buys
# (variants.md). Logs and the tables go to $OUT (or ./output).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-output}
mkdir -p "$OUT"
# An offline machine can take the Python packages the tests need as wheels in ./.whl.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/detops-site .whl/*.whl && export PYTHONPATH=/tmp/detops-site${PYTHONPATH:+:$PYTHONPATH}
fi
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__, 'cuda', torch.version.cuda)"
start=$(date +%s)
if ! python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1; then
  tail -n 60 "$OUT/build.log"; exit 1
fi
echo "build: $(( $(date +%s) - start )) s"; grep -i "warning" "$OUT/build.log" | grep -v "UserWarning" | head -n 20
python3 -m pytest tests -q -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/tests.log" | tail -n 40
echo "tests: $(( $(date +%s) - start )) s"
python3 -m benchmarks.run_all --device ${BENCH_DEVICE:-all} --out "$OUT/benchmarks.md" 2>&1 | tee "$OUT/bench.log" | tail -n 60
echo "benchmarks: $(( $(date +%s) - start )) s"
python3 -m benchmarks.bench_variants --device cuda --out "$OUT/variants.md" 2>&1 | tee "$OUT/variants.log" | tail -n 100
echo "total: $(( $(date +%s) - start )) s"
