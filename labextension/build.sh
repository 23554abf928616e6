#!/usr/bin/env bash
# Build nbtrain's JupyterLab extension from a clean clone and install it into the Python env.
#
#   bash labextension/build.sh          # PYTHON=/path/to/python to use another interpreter
#
# npm ci installs exactly package-lock.json; `npm run build:prod` compiles the TypeScript and
# bundles it with @jupyter/builder into labextension/prebuilt/ (ignored by git); the editable
# install then copies it, with the server extension's enable file, into the env's share/ and etc/.
set -euo pipefail
cd "$(dirname "$0")"
REPO=$(cd .. && pwd)
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
export PATH="$(dirname "$PYTHON"):$PATH"

"$PYTHON" -m pip install -q "hatchling>=1.21" "hatch-jupyter-builder>=0.9" "jupyter-builder>=1.3" editables
# npm ci installs the lockfile as it is, and refuses one out of step with package.json. The
# lockfile holds every platform's optional rspack/rollup bindings, so npm install (which
# hatch-jupyter-builder runs in `pip install -e .`) leaves it as it is too; tests/test_cli.py checks
# that npm ci accepts it. Where a registry mirror lacks some of those bindings (npm/cli#4828, #8320),
# npm ci fails: then install from the same lockfile without rewriting it (--no-save).
npm ci --no-audit --no-fund 2>/dev/null || npm install --no-save --no-audit --no-fund
npm run build:prod
# no build isolation: the build hook sees the fresh prebuilt/ and skips its own npm run
"$PYTHON" -m pip install -q --no-deps --no-build-isolation -e "$REPO"
