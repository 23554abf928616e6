#!/usr/bin/env bash
# Every test of the JupyterLab extension and the server extension, on a fresh machine:
#
#   bash labextension/run-tests.sh      # PYTHON=/path/to/python to use another interpreter
#
# Installs what it needs (Debian's chromium, the Python test deps, npm packages), builds the
# extension, then runs: prettier + eslint, the TypeScript data layer's unit tests (vitest), the
# REST handlers' tests (pytest-jupyter), and the UI tests in headless Chromium against a real
# JupyterLab (Playwright). Screenshots: tests/_artifacts/ui/ and docs/images/lab-sidebar.png.
set -euo pipefail
cd "$(dirname "$0")"
REPO=$(cd .. && pwd)
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
export PYTHON
export PATH="$(dirname "$PYTHON"):$PATH"

if [ ! -x /usr/bin/chromium ]; then
    apt-get update -q && apt-get install -y -q chromium
fi
"$PYTHON" -m pip install -q "jupyterlab>=4.2,<5" "pytest-jupyter[server]>=0.10" "pytest-timeout>=2.2"

# LAB_BUILT=1: build.sh has run already (make test builds first, then runs this beside the Python
# tests, which must not see build.sh's `pip install -e` of nbtrain happen under them)
if [ "${LAB_BUILT:-}" != 1 ]; then
    bash ./build.sh
fi

step() { printf '\n=== %s (%ss)\n' "$1" "$SECONDS"; }
step "prettier + eslint"
npm run -s lint:check
step "vitest: the TypeScript data layer"
npx vitest run
step "pytest: the REST handlers"
(cd "$REPO" && "$PYTHON" -m pytest -q -p no:cacheprovider tests/server/test_handlers.py)
step "playwright: UI tests in headless chromium"
npx playwright test
step "done"
