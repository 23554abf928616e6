"""nbtrain's Tinker-compatible service, in one package with its two sides named by where they run:

- `nbtrain.tinker.kernel`: in the notebook kernel, the HTTP server the tinker SDK talks to, its
  futures, sessions and models, and where the verbs run (`kernel.backend`);
- `nbtrain.tinker.ranks`: on every rank, the verbs themselves (`forward_backward`, `optim_step`,
  sampling, saves), with no kernel or server code.

In [1]: svc = nbtrain.tinker.serve_tinker()          # or cluster.serve_tinker()
In [2]: nbtrain.tinker.current_service().url

This package's own names are the kernel side's public ones, imported when first used, so that a rank
importing `nbtrain.tinker.ranks` never loads tornado or the kernel side.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

log = logging.getLogger(__name__)

__all__ = [
    "ClusterBackend",
    "InProcessBackend",
    "TinkerService",
    "current_service",
    "serve",
    "serve_tinker",
    "tinker_url",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("nbtrain.tinker.kernel"), name)
    msg = f"module 'nbtrain.tinker' has no attribute {name!r}"
    raise AttributeError(msg)
