#!/usr/bin/env bash
# The README's main command: set up a venv (once) and generate with the embedded tiny model (CPU here; on a GPU
# machine the same command captures CUDA graphs). Extra args go to examples.generate (--explain: what fgraph made).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
# (torch 2.13.0, the release pyproject.toml's range ends at: on the CPU box, its local CPU wheel)
.venv/bin/pip install --progress-bar on torch==2.13.0 | grep -v "^Requirement already satisfied" || true
.venv/bin/pip install --progress-bar on -e '.[examples]' | grep -v "^Requirement already satisfied" || true
echo "fgraph demo: the tiny model has random weights, so its tokens are noise; the tokens come first, then the speed"
echo "(add --explain to see the signatures, pieces and graphs fgraph made)"
exec .venv/bin/python -m examples.generate "$@"
