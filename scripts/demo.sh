#!/usr/bin/env bash
# The main job: train on the real digits data set and print accuracy and throughput.
# Sets up ./.venv on first use. Extra arguments go to `tandem train`.
source "$(dirname "$0")/env.sh"
python -m tandem train --model resnet --data digits --epochs 5 --batch-size 64 "$@"
