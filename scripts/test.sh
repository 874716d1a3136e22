#!/usr/bin/env bash
# The whole test suite: lint, type check, the docs site, then every test. Sets up ./.venv on first use.
source "$(dirname "$0")/env.sh"
echo "[test] ruff";  ruff check tandem tests bench
echo "[test] mypy";  mypy
echo "[test] docs";  NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet   # the site, warnings as errors -> site/
# pytest-xdist: one worker per core (at most 4); tests/conftest.py keeps tests/distributed on one worker.
# A worker that crashes (a native abort) ends the run, failing, instead of being replaced: under
# loadgroup a replaced worker can leave the run waiting forever (pytest-xdist issues #1323, #1378).
echo "[test] pytest"; python -m pytest -q -n auto --maxprocesses 4 --dist loadgroup --max-worker-restart 0 "$@"
