#!/usr/bin/env bash
# Headless Chromium for tests/tune/test_dashboard_browser.py, which opens the real
# optuna-dashboard in it. Debian's chromium package is used because Playwright's own browser
# download comes from a host a closed network does not reach; the test drives this binary
# through the playwright Python package (the `test` extra) with executable_path.
# fonts-liberation gives the screenshots legible text (it is only a recommendation of chromium).
# Idempotent: does nothing when a working chromium is already on PATH. Needs root (or sudo).
set -euo pipefail

works() {
  # /usr/bin/chromium is a shell wrapper that may print noise on stderr; the version line is on stdout
  command -v chromium >/dev/null 2>&1 && [[ "$(chromium --version 2>/dev/null)" == Chromium\ * ]]
}

if works && [[ "$(fc-list 2>/dev/null)" == *Liberation* ]]; then
  echo "install-browser: $(chromium --version 2>/dev/null) is installed"
  exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
  SUDO=()
elif command -v sudo >/dev/null 2>&1; then
  SUDO=(sudo)
else
  echo "install-browser: needs root (or sudo) to run apt-get install chromium" >&2
  exit 1
fi

export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -q
"${SUDO[@]}" apt-get install -y -q chromium fonts-liberation

if ! works; then
  echo "install-browser: chromium was installed but 'chromium --version' does not run" >&2
  exit 1
fi
echo "install-browser: $(chromium --version 2>/dev/null) is installed"
