#!/usr/bin/env bash
# The README's test command: set up a venv (once) and run the CPU suite, then fgraph's Triton kernels' specs in
# Triton's interpreter. GPU tests skip on CPU. Arguments: one pytest run with them instead.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e '.[test]'
# one style, enforced (PEP 8 via ruff: lint and format, configured in pyproject.toml)
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# two pytest-xdist workers (CI and the dev box have 2 cores; more would only contend): -n 0 in "$@" runs in one process
if [ $# -gt 0 ]; then exec .venv/bin/python -m pytest -q -x -n 2 "$@"; fi
.venv/bin/python -m pytest -q -x -n 2
# fgraph's Triton kernels on the CPU, in Triton's interpreter: the specs marked `interpreter`, which skip above
# (fgraph::linear's configs, the triton attention, RoPE, sdpa_decode against eager)
TRITON_INTERPRET=1 exec .venv/bin/python -m pytest -q -x -n 2 -m interpreter
