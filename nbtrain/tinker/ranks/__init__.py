"""The rank side of nbtrain's Tinker-compatible service: the verbs the kernel's HTTP server runs on
every rank with the same arguments (or in one process, with no process group).

In [1]: from nbtrain.tinker import ranks as service
In [2]: service.create_model("m1", "/models/tiny", {"rank": 8})
In [3]: service.forward_backward("m1", datums, "cross_entropy", None, False)["metrics"]["loss:sum"]
In [4]: service.optim_step("m1", {"learning_rate": 1e-4})
In [5]: service.batch([("forward_backward", (...)), ("optim_step", (...))])  # both in one call

State lives in this process (`registry`): each base model loaded once, a LoRA adapter and an AdamW per
training model, sampler snapshots. Plain data crosses (dicts, lists, numbers, numpy arrays), so a call
pickles cheaply through ipyparallel. A model id this process does not hold raises `UnknownModelError`
(the server's 404); a bad request raises `nbtrain.errors.ConfigError` (its 400).
"""

from __future__ import annotations

from nbtrain.tinker.ranks.batch import batch
from nbtrain.tinker.ranks.lifecycle import create_model, status, unload
from nbtrain.tinker.ranks.preemption import (
    arm_preemption,
    disarm_preemption,
    preemption_status,
)
from nbtrain.tinker.ranks.registry import UnknownModelError
from nbtrain.tinker.ranks.sample import sample
from nbtrain.tinker.ranks.state import (
    checkpoint_all,
    load_state,
    save_sampler,
    save_state,
    snapshot,
    weights,
)
from nbtrain.tinker.ranks.train import forward_backward, optim_step

__all__ = [
    "UnknownModelError",
    "arm_preemption",
    "batch",
    "checkpoint_all",
    "create_model",
    "disarm_preemption",
    "forward_backward",
    "load_state",
    "optim_step",
    "preemption_status",
    "sample",
    "save_sampler",
    "save_state",
    "snapshot",
    "status",
    "unload",
    "weights",
]
