#!/usr/bin/env bash
# The GPU part of benchmarks/RESULTS.md: every model and method on CUDA, in steps of under
# 10 minutes each (one model, one part per step), each adding its rows to
# benchmarks/results/cuda/<model>.json as it goes; RESULTS.md and the plots are rendered at
# the end. Run it from a clean checkout with torchvision installed:
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
"$PY" benchmarks/render.py
exit "$status"
