#!/usr/bin/env bash
# Everything the package claims on a GPU, in one command: the predicted against the measured
# peak of a training step (benchmarks/prediction.py --measure), the offload overlap (the idle time of
# the compute stream with and without offloading, benchmarks/overlap.py), then the GPU part
# of benchmarks/RESULTS.md: every model and method on CUDA, in steps of under 10 minutes each
# (one model, one part per step), each adding its rows to benchmarks/results/cuda/<model>.json
# as it goes; RESULTS.md and the plots are rendered at the end, its CUDA tables printed, and
# every measured plan's predicted against measured peak and extra time.
# Run it from a clean checkout with torchvision installed:
#
#   bash benchmarks/gpu.sh                  # every model, every part
#   bash benchmarks/gpu.sh resnet50         # one model, every part
#   bash benchmarks/gpu.sh resnet50 peers   # one step: peers | ours | batch
#
# PYTHON picks the interpreter (default: python); STEP_SECONDS the limit per step (570).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
STEP_SECONDS=${STEP_SECONDS:-570}
MODELS=${1:-"resnet50 resnet101 resnet152 vgg19 densenet121 unet gpt"}
PARTS=${2:-"peers ours batch"}
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu.sh: no CUDA device')" || exit 1
status=0
step() {  # step <label> <command...>: run one step under the time limit, note a failure
  local label=$1
  shift
  echo "== $label ($(date -u +%H:%M:%S))"
  timeout "$STEP_SECONDS" "$@"
  local rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "!! $label ended with status $rc (124: over ${STEP_SECONDS} s)"
    status=1
  fi
}
if [ -z "${2:-}" ]; then
  step "predicted vs measured peak" "$PY" benchmarks/prediction.py --measure --device cuda --python "$PY"
  step "offload overlap" "$PY" benchmarks/overlap.py
fi
for model in $MODELS; do
  for part in $PARTS; do
    echo "== $model $part ($(date -u +%H:%M:%S))"
    timeout "$STEP_SECONDS" "$PY" benchmarks/run.py --device cuda --tag cuda --models "$model" \
      --part "$part" --no-render --timeout 240
    rc=$?
    if [ "$rc" -ne 0 ]; then
      echo "!! $model $part ended with status $rc (124: over ${STEP_SECONDS} s; its rows so far are kept)"
      status=1
    fi
  done
done
"$PY" benchmarks/render.py || status=1
echo "== every measured plan, predicted against measured (benchmarks/prediction.py --tag cuda)"
"$PY" benchmarks/prediction.py --tag cuda || status=1
echo "== benchmarks/RESULTS.md, CUDA tables"
awk '/^## /{show = ($2 == "cuda")} show' benchmarks/RESULTS.md
exit "$status"
