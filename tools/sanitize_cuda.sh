#!/usr/bin/env bash
# compute-sanitizer over every detops CUDA kernel: memcheck, racecheck, initcheck and synccheck,
# each running tools/sanitize_cuda_driver.py (every op, every forced kernel variant, every
# dtype, forward and backward, empty and odd shapes). Prints each tool's error count and exits
# non-zero when any tool reports an error or the driver fails (an exception, or variants that
# disagree). Needs a GPU and a detops._C built with its CUDA kernels.
#
#   bash tools/sanitize_cuda.sh                # coverage, then the four tools
#   bash tools/sanitize_cuda.sh memcheck       # some of: coverage memcheck racecheck initcheck synccheck
#
# Environment: COMPUTE_SANITIZER (the executable; default: on the PATH, else under CUDA_HOME or
# /usr/local/cuda), PYTHON, DETOPS_SANITIZE_FULL=1 (the full driver matrix; by default memcheck,
# racecheck and initcheck run the driver's --quick matrix), DETOPS_SANITIZE_ARGS (more
# compute-sanitizer options), DETOPS_SANITIZE_DRIVER_ARGS (more driver options, e.g.
# "--only roi_align,roi_pool" to split a run), LOG_DIR (default build/sanitize_cuda: one log per
# tool).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

PYTHON=${PYTHON:-python3}
LOG_DIR=${LOG_DIR:-build/sanitize_cuda}
TOOLS=("$@")
if [ ${#TOOLS[@]} -eq 0 ]; then TOOLS=(coverage memcheck racecheck initcheck synccheck); fi

SANITIZER=${COMPUTE_SANITIZER:-}
if [ -z "$SANITIZER" ]; then
  for c in "$(command -v compute-sanitizer 2>/dev/null || true)" "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" \
    "${CUDA_HOME:-/usr/local/cuda}/compute-sanitizer/compute-sanitizer" /usr/local/cuda/bin/compute-sanitizer; do
    if [ -n "$c" ] && [ -x "$c" ]; then SANITIZER=$c; break; fi
  done
fi

# With torch's caching allocator a tensor is a slice of a larger cudaMalloc block, so a read or
# write past its end lands in memory the sanitizer sees as allocated (memcheck stays silent) and
# initialized by an earlier tensor (initcheck stays silent). Without the cache every tensor is a
# cudaMalloc of its own, whose bounds and initialization the tools track exactly.
export PYTORCH_NO_CUDA_MEMORY_CACHING=1

mkdir -p "$LOG_DIR"
status=0
summary=()
for tool in "${TOOLS[@]}"; do
  # shellcheck disable=SC2206
  driver=("$PYTHON" tools/sanitize_cuda_driver.py ${DETOPS_SANITIZE_DRIVER_ARGS:-})
  opts=()
  case "$tool" in
    coverage)
      # no sanitizer: which kernels of csrc/cuda the driver launches (torch.profiler)
      start=$SECONDS
      "${driver[@]}" --kernels 2>&1 | tee "$LOG_DIR/coverage.log"
      rc=${PIPESTATUS[0]}
      never=$(grep -c '^  never launched:' "$LOG_DIR/coverage.log")
      summary+=("coverage: driver exit $rc, $never kernels of csrc/cuda never launched, $((SECONDS - start)) s")
      [ "$rc" = 0 ] || status=1
      continue
      ;;
    memcheck)
      # --padding: a gap after every allocation, so that an access just past one tensor's end
      # cannot land in the next tensor's allocation and pass as valid
      opts=(--padding 512)
      # the full matrix takes memcheck over six minutes for nms alone on an H100
      if [ "${DETOPS_SANITIZE_FULL:-0}" != 1 ]; then driver+=(--quick); fi
      ;;
    racecheck)
      # analysis (the default report): one report per racing pair of source lines, rather than
      # one per hazardous access (hazard); rerun with --racecheck-report hazard for those
      opts=(--racecheck-report analysis)
      if [ "${DETOPS_SANITIZE_FULL:-0}" != 1 ]; then driver+=(--quick); fi
      ;;
    initcheck)
      # reads of uninitialized global memory only: a buffer not wholly written (the kernels'
      # scratch sized for the worst case, allocations rounded up) is no error
      opts=(--track-unused-memory no)
      if [ "${DETOPS_SANITIZE_FULL:-0}" != 1 ]; then driver+=(--quick); fi
      ;;
    synccheck)
      ;;
    *)
      echo "sanitize_cuda.sh: unknown tool '$tool' (coverage, memcheck, racecheck, initcheck, synccheck)" >&2
      exit 2
      ;;
  esac
  if [ -z "$SANITIZER" ]; then
    echo "sanitize_cuda.sh: compute-sanitizer not found (set COMPUTE_SANITIZER)" >&2
    exit 2
  fi
  log="$LOG_DIR/$tool.log"
  echo "== $tool: $SANITIZER --tool $tool ${opts[*]} ${driver[*]}"
  start=$SECONDS
  # --report-api-errors no: a CUDA call that fails is already an error where detops and torch
  # make it (C10_CUDA_CHECK, C10_CUDA_KERNEL_LAUNCH_CHECK: the driver fails); runtime calls that
  # fail by design (torch probing what the device supports) are no finding.
  # shellcheck disable=SC2086
  "$SANITIZER" --tool "$tool" --error-exitcode 1 --print-limit 50 --report-api-errors no \
    "${opts[@]}" ${DETOPS_SANITIZE_ARGS:-} "${driver[@]}" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  # "ERROR SUMMARY: N errors"; racecheck: "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)"
  errors=$(grep -oE 'ERROR SUMMARY: [0-9]+' "$log" | tail -1 | grep -oE '[0-9]+$')
  if [ -z "$errors" ]; then
    errors=$(grep -oE 'SUMMARY: [0-9]+ hazards displayed \([0-9]+ errors' "$log" | tail -1 | grep -oE '[0-9]+ errors' | grep -oE '[0-9]+')
  fi
  warnings=$(grep -oE '[0-9]+ warnings\)' "$log" | tail -1 | grep -oE '[0-9]+')
  line="$tool: ${errors:-?} errors${warnings:+, $warnings warnings}, exit $rc, $((SECONDS - start)) s"
  summary+=("$line")
  if [ "$rc" != 0 ] || [ "${errors:-1}" != 0 ]; then status=1; fi
done

echo
echo "detops CUDA sanitizers (logs in $LOG_DIR):"
for line in "${summary[@]}"; do echo "  $line"; done
if [ "$status" != 0 ]; then
  echo "sanitize_cuda.sh: FAILED" >&2
fi
exit "$status"
