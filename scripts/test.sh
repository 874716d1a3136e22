#!/usr/bin/env bash
# The whole test suite: lint, type check, then every test. Sets up ./.venv on first use.
source "$(dirname "$0")/env.sh"
echo "[test] ruff";  ruff check tandem tests bench
echo "[test] mypy";  mypy
echo "[test] pytest"; python -m pytest -q "$@"
