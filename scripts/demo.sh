#!/usr/bin/env bash
# The main job: data-parallel training on the real digits data set, on local processes:
# 2 workers + 2 parameter servers, P3 priority propagation, memory-aware mirroring.
# Prints accuracy, samples/s, and where the training plots and the Perfetto traces went.
# Sets up ./.venv on first use. Extra arguments go to `tandem train` (e.g. --epochs 3).
source "$(dirname "$0")/env.sh"
OUT="${TANDEM_DEMO_OUT:-runs/demo}"
mkdir -p "$OUT"
export TANDEM_TRACE="$OUT/trace-{pid}.json"   # one Chrome/Perfetto trace per process
python -m tandem launch -n 2 -s 2 --p3 -- \
  python -m tandem train --model resnet --data digits --epochs 5 --batch-size 64 \
    --kvstore dist_p3 --mirror memory-aware --out "$OUT" --no-progress "$@"
