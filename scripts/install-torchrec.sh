#!/usr/bin/env bash
# TorchRec for tests/torchrec (the `torchrec` extra), on a CPU machine: torchrec 1.8.0 with
# fbgemm-gpu-cpu 1.8.0, the pair that loads with the CPU build of torch 2.13. Both go in with
# --no-deps because torchrec declares the CUDA `fbgemm-gpu` wheel, which would replace the CPU
# one (and then fails to import); 1.9.x does not load against torch 2.13. torchrec's small
# dependencies follow, with torch held at the installed build.
# Idempotent: does nothing when torchrec already imports. Skipped (with a line) where torch
# is a CUDA build: fbgemm-gpu-cpu does not fit there, and tests/torchrec then skips itself.
# Usage: scripts/install-torchrec.sh [python]   (default: the python on PATH)
set -euo pipefail

PY="${1:-python}"
TORCH="$("$PY" -c 'import torch; print(torch.__version__)')"

if "$PY" -c 'import torchrec, fbgemm_gpu' >/dev/null 2>&1; then
  echo "install-torchrec: torchrec $("$PY" -c 'import importlib.metadata as m; print(m.version("torchrec"))') is installed"
  exit 0
fi
if "$PY" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)'; then
  echo "install-torchrec: skipped: torch $TORCH is a CUDA build (fbgemm-gpu-cpu is for CPU builds only)"
  exit 0
fi

CONSTRAINT="$(mktemp)"
trap 'rm -f "$CONSTRAINT"' EXIT
echo "torch==$TORCH" >"$CONSTRAINT"
"$PY" -m pip install -q --no-deps "torchrec==1.8.0" "fbgemm-gpu-cpu==1.8.0"
"$PY" -m pip install -q -c "$CONSTRAINT" "torchmetrics==1.0.3" tensordict pyre-extensions tqdm

if ! "$PY" -c 'import torchrec, fbgemm_gpu; from torchrec.models.dlrm import DLRM' >/dev/null 2>&1; then
  echo "install-torchrec: torchrec was installed but does not import with torch $TORCH" >&2
  exit 1
fi
echo "install-torchrec: torchrec 1.8.0 (fbgemm-gpu-cpu 1.8.0) is installed for torch $TORCH"
