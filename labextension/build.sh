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
# npm ci refuses a lockfile that lacks some platform's optional binaries (npm/cli#4828, #8320);
# here the registry mirror has no android/darwin builds of the newest rollup/rspack bindings, so
# npm could not record them. Then install from the same lockfile without rewriting it.
npm ci --no-audit --no-fund 2>/dev/null || npm install --no-save --no-audit --no-fund
npm run build:prod
# no build isolation: the build hook sees the fresh prebuilt/ and skips its own npm run
"$PYTHON" -m pip install -q --no-deps --no-build-isolation -e "$REPO"
