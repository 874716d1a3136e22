#!/usr/bin/env bash
# The whole test suite: lint, type check, the docs site, then every test. Sets up ./.venv on first use.
source "$(dirname "$0")/env.sh"
echo "[test] ruff";  ruff check tandem tests bench
echo "[test] mypy";  mypy
echo "[test] docs";  NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet   # the site, warnings as errors -> site/
# pytest-xdist: one worker per core (at most 4); tests/conftest.py keeps tests/distributed on one worker
echo "[test] pytest"; python -m pytest -q -n auto --maxprocesses 4 --dist loadgroup "$@"
