#!/usr/bin/env bash
# A real training example: a Hugging Face transformers causal LM (GPT-2, built from its config class:
# byte-level, 2 layers, hidden 64, 0.12M parameters) trained on a real English corpus that ships with
# Python (pydoc_data: the text of Python's help() topics), data-parallel on local processes: 2 workers
# + 2 parameter servers started by `tandem launch`, P3 priority propagation. Each worker shows a
# progress bar and prints the validation perplexity per epoch; a loss + perplexity plot per worker
# lands in runs/lm/training-rank*.png. About 2-4 minutes on 2 CPU cores.
# Sets up ./.venv on first use (with the models extra: transformers). Extra arguments go to
# `tandem train` (e.g. --epochs 3, or --model hf-llama).
source "$(dirname "$0")/env.sh"
OUT="${TANDEM_LM_OUT:-runs/lm}"
mkdir -p "$OUT"
python -m tandem launch -n 2 -s 2 --p3 -- \
  python -m tandem train --model hf-gpt2 --data pydoc-text --epochs 8 --batch-size 32 \
    --optimizer adamw --lr 3e-3 --weight-decay 0.01 --kvstore dist_p3 --communication p3 --out "$OUT" "$@"
python - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
history = json.loads((out / "history-rank0.json").read_text())
print("validation perplexity by epoch: " + " -> ".join(f"{r['eval_perplexity']:.2f}" for r in history))
print("plots: " + ", ".join(str(p) for p in sorted(out.glob("training-rank*.png"))))
PY
