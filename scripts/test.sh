#!/usr/bin/env bash
# The README's test command: set up a venv (once) and run the CPU suite. GPU tests skip on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e '.[test]'
# one style, enforced (PEP 8 via ruff: lint and format, configured in pyproject.toml)
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# two pytest-xdist workers (CI and the dev box have 2 cores; more would only contend): -n 0 in "$@" runs in one process
exec .venv/bin/python -m pytest -q -x -n 2 "$@"
