#!/usr/bin/env bash
# The README's main command: set up a venv (once) and generate with the embedded tiny model
# (CPU here; on a GPU machine the same command captures CUDA graphs). Extra args go to examples.generate.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e '.[examples]'
exec .venv/bin/python -m examples.generate --explain "$@"
