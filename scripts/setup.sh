#!/usr/bin/env bash
# Idempotent set-up: a virtualenv in .venv holding erase-tune (editable) and its dependencies.
#
# torch: a machine that already has torch (e.g. a GPU box with its CUDA build) keeps it.
# Otherwise, with an NVIDIA GPU we install a CUDA torch; without one, the CPU build
# ${TORCH_SPEC:-torch==2.13.0} (set TORCH_INDEX to a CPU-wheel index where PyPI's default
# wheel for that version would be a multi-GB CUDA build), so a CPU-only machine never
# downloads CUDA. A re-run with nothing changed takes a second.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  # --system-site-packages lets a machine's own CUDA torch count as installed.
  "$PY" -m venv --system-site-packages .venv
fi
. .venv/bin/activate
stamp=.venv/.erase-tune-installed
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    python -m pip install -q "torch>=2.11,<2.15"
  else
    python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
  fi
fi
python -m pip install -q -e '.[test]'
echo "$want" > "$stamp"
python -c "import torch, erase_tune; print(f'erase-tune {erase_tune.__version__} ready: torch {torch.__version__}, cuda available: {torch.cuda.is_available()}')"
