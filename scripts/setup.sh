#!/usr/bin/env bash
# Idempotent set-up for `make test` and `make demo` on a fresh machine, in three steps, each
# saying what it does and doing nothing when its part is already there (a re-run takes a
# second or two):
#
#  1. python: a virtualenv in .venv holding erase-tune (editable) and its dependencies.
#     torch: a machine that already has torch (e.g. a GPU box with its CUDA build) keeps it.
#     Otherwise, with an NVIDIA GPU we install a CUDA torch; without one, the CPU build
#     ${TORCH_SPEC:-torch==2.13.0} (set TORCH_INDEX to a CPU-wheel index where PyPI's default
#     wheel for that version would be a multi-GB CUDA build), so a CPU-only machine never
#     downloads CUDA.
#  2. postgresql (`make test` only): the storage tests need a server on 127.0.0.1:5432 (trust
#     auth, database `test`). If none answers and this machine has a Debian/Ubuntu cluster
#     (pg_ctlcluster), it is started and waited for (up to 30 s). Nothing is installed.
#  3. browser (`make test` only): Debian's chromium and fonts-liberation for the real-browser
#     dashboard test (scripts/install-browser.sh; apt-get, needs root or sudo).
#  Extra installers for optional test dependencies go in EXTRA_INSTALLERS below.
#  Every run also byte-compiles the checkout's own sources (erase_tune, tests, examples): an
#  editable install is not compiled, and where PYTHONDONTWRITEBYTECODE is set (as on many CI
#  images) every process compiled erase-tune from source at each start, about 0.4 CPU-s each,
#  for the hundreds of trial workers and commands a test run starts. Python reads the compiled
#  files even with that setting; only changed files are compiled again.
#
# Usage: scripts/setup.sh [python|test]   (python: step 1 only, what `make demo` needs;
# test, the default: all steps). SKIP_SYSTEM_SETUP=1 skips steps 2-3 (a machine where the
# server and browser are managed by someone else).
set -euo pipefail

# Installers of optional test dependencies, run by step 3 in this order (each idempotent,
# each prints one line when there is nothing to do).
EXTRA_INSTALLERS=(scripts/install-browser.sh)
# Python test dependencies that pip cannot resolve from pyproject.toml alone (installed into
# .venv, so they run even with SKIP_SYSTEM_SETUP): TorchRec's CPU pair needs --no-deps.
TEST_INSTALLERS=(scripts/install-torchrec.sh)

setup_python() {
  local PY=${PYTHON:-python3}
  if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $PY"
    # --system-site-packages lets a machine's own CUDA torch count as installed.
    "$PY" -m venv --system-site-packages .venv
  fi
  local stamp=.venv/.erase-tune-installed
  local want
  want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    echo "setup: python: .venv is up to date"
    return 0
  fi
  (
    . .venv/bin/activate
    echo "setup: python: installing erase-tune (editable, with the tune and test extras) into .venv"
    python -m pip install -q --upgrade pip
    if ! python -c "import torch" 2>/dev/null; then
      if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo "setup: python: installing a CUDA build of torch (an NVIDIA GPU is present)"
        python -m pip install -q "torch>=2.11,<2.15"
      else
        echo "setup: python: installing the CPU build ${TORCH_SPEC:-torch==2.13.0}"
        python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
      fi
    fi
    python -m pip install -q -e '.[test]'
    echo "$want" > "$stamp"
    python -c "import torch, erase_tune; print(f'setup: python: erase-tune {erase_tune.__version__} ready: torch {torch.__version__}, cuda available: {torch.cuda.is_available()}')"
  )
}

setup_bytecode() {
  .venv/bin/python -m compileall -q -j 0 erase_tune tests examples >/dev/null
}

pg_up() { pg_isready -h 127.0.0.1 -p 5432 -q 2>/dev/null; }

setup_postgresql() {
  if ! command -v pg_isready >/dev/null 2>&1; then
    echo "setup: postgresql: not installed here (no pg_isready); the PostgreSQL tests will be skipped or fail:" \
         "install postgresql and start a server on 127.0.0.1:5432 (trust auth, database 'test')" >&2
    return 0
  fi
  if pg_up; then
    echo "setup: postgresql: a server answers on 127.0.0.1:5432"
    return 0
  fi
  local version
  version=$(ls /etc/postgresql 2>/dev/null | sort -V | tail -1 || true)
  if [ -z "$version" ] || ! command -v pg_ctlcluster >/dev/null 2>&1; then
    echo "setup: postgresql: no server answers on 127.0.0.1:5432 and there is no Debian cluster to start" \
         "(pg_ctlcluster); start yours, then re-run" >&2
    return 1
  fi
  echo "setup: postgresql: no server answers on 127.0.0.1:5432: starting cluster $version/main (pg_ctlcluster)"
  local run=()
  if [ "$(id -u)" -ne 0 ] && [ "$(id -un)" != postgres ]; then
    if command -v sudo >/dev/null 2>&1; then run=(sudo); else
      echo "setup: postgresql: starting the cluster needs root, sudo or the postgres user" >&2
      return 1
    fi
  fi
  "${run[@]+"${run[@]}"}" pg_ctlcluster --skip-systemctl-redirect "$version" main start
  local _
  for _ in $(seq 1 "${PG_START_WAIT_S:-30}"); do
    pg_up && { echo "setup: postgresql: cluster $version/main is up"; return 0; }
    sleep 1
  done
  echo "setup: postgresql: cluster $version/main was started but does not answer on 127.0.0.1:5432 after ${PG_START_WAIT_S:-30} s" \
       "(see /var/log/postgresql/postgresql-$version-main.log)" >&2
  return 1
}

setup_extras() {
  local installer
  for installer in "${EXTRA_INSTALLERS[@]}"; do
    echo "setup: running $installer"
    bash "$installer"
  done
}

main() {
  cd "$(dirname "${BASH_SOURCE[0]}")/.."
  local what=${1:-test}
  case "$what" in python|test) ;; *) echo "setup: unknown step set '$what' (python or test)" >&2; exit 2 ;; esac
  setup_python
  setup_bytecode
  if [ "$what" = test ]; then
    local installer
    for installer in "${TEST_INSTALLERS[@]}"; do
      echo "setup: running $installer"
      bash "$installer" .venv/bin/python
    done
  fi
  if [ "$what" = test ] && [ -z "${SKIP_SYSTEM_SETUP:-}" ]; then
    setup_postgresql
    setup_extras
  fi
}

# Sourced (tests/test_setup.py checks the steps' logic with stand-in commands): functions only.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
fi
