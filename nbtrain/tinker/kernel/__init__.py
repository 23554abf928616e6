"""The kernel side of nbtrain's Tinker-compatible service: the official `tinker` SDK (0.38.0) and
unchanged tinker-cookbook recipes train LoRA models that live on the cluster between requests.

In the notebook kernel: HTTP (`handlers`), futures in `seq_id` order (`futures`), the endpoints'
logic (`verbs`), the wire formats (`wire`), ids and paths (`protocol`), runs and live plots
(`tracking`), and where the verbs run (`backend`: the cluster's ranks, or this kernel). The verbs
themselves run on every rank, in `nbtrain.tinker.ranks`.
"""

from __future__ import annotations

from nbtrain.tinker.kernel.backend import ClusterBackend, InProcessBackend
from nbtrain.tinker.kernel.serve import (
    TinkerService,
    current_service,
    serve,
    serve_tinker,
    tinker_url,
)

__all__ = [
    "ClusterBackend",
    "InProcessBackend",
    "TinkerService",
    "current_service",
    "serve",
    "serve_tinker",
    "tinker_url",
]
