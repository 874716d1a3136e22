# Sourced by the other scripts: create or reuse ./.venv and install tandem with what it needs.
# torch is pinned to exactly 2.13.0: any other spec makes pip fetch GBs of CUDA wheels.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV with $PY"
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.tandem-installed"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
  echo "[setup] installing tandem and its dependencies (torch==2.13.0)"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==2.13.0"
  # [models]: transformers, timm and torchvision==0.28.0 (the build paired with torch 2.13.0) for the
  # conformance suite and the hf-* models; the pin keeps pip from swapping torch for another version.
  # [docs]: mkdocs and mkdocstrings for the documentation site.
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$ROOT[dev,models,docs]"
  touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
