#!/bin/sh
# torch for `make dev`, CPU build by default:
#
#   sh scripts/install-torch.sh PYTHON REQUIREMENT INDEX_URL
#
# 1. REQUIREMENT already satisfied in PYTHON's environment: nothing to do (no network).
# 2. INDEX_URL (PyTorch's CPU wheel index) answers within 5 s: install from it. The CPU build is
#    ~190 MB; PyPI's Linux build of torch pulls several GB of CUDA packages.
# 3. Otherwise (CI machines reach PyPI only), or if that install fails: pip's default index, with its
#    own configuration (local wheels where pip is configured with them, else PyPI's build).
set -eu
py=$1
torch=$2
index=$3

if "$py" - "$torch" <<'PYEOF'
import sys
from importlib.metadata import PackageNotFoundError, version

from pip._vendor.packaging.requirements import Requirement

try:
    req = Requirement(sys.argv[1])
    have = version(req.name)
except (PackageNotFoundError, ValueError):  # not installed, or not a plain requirement
    sys.exit(1)
sys.exit(0 if req.specifier.contains(have, prereleases=True) else 1)
PYEOF
then
    echo "install-torch: $torch is already installed; keeping it"
    exit 0
fi

if "$py" - "$index" <<'PYEOF'
import sys
import urllib.request

# one short request decides: pip would otherwise wait on every package page of an unreachable index
try:
    urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=5).close()
except Exception as e:
    print(f"install-torch: {sys.argv[1]}: {e}", file=sys.stderr)
    sys.exit(1)
PYEOF
then
    echo "install-torch: installing $torch from $index"
    if "$py" -m pip install -q --index-url "$index" "$torch"; then
        exit 0
    fi
    echo "install-torch: installing $torch from $index failed (above); trying pip's default index" >&2
else
    echo "install-torch: $index cannot be reached; installing $torch from pip's default index" \
        "(on Linux from PyPI that is the CUDA build, several GB)" >&2
fi
exec "$py" -m pip install -q "$torch"
