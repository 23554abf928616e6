"""nbtrain: distributed training from a Jupyter notebook.

In [1]: %load_ext nbtrain
In [2]: %nbtrain start -n 2
In [3]: %%distributed
   ...: print(rank, world_size)

Importing nbtrain is cheap: torch, transformers and IPython load only where they are used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from nbtrain import logs as _logs
from nbtrain.engine import metrics as _metrics
from nbtrain.version import __version__

__all__ = [
    "Cluster",
    "ClusterPicker",
    "ConfigError",
    "DPOConfig",
    "DistributedCellError",
    "GRPOConfig",
    "Hooks",
    "Preempted",
    "Run",
    "SFTConfig",
    "TrainResult",
    "__version__",
    "attach",
    "check",
    "check_model",
    "compare",
    "connect",
    "current_cluster",
    "finetune",
    "generate",
    "is_rank_zero",
    "load_ipython_extension",
    "log",
    "log_end",
    "scaling",
    "serve_tinker",
    "set_log_level",
    "start",
    "tinker_url",
    "unload_ipython_extension",
]

# name -> module that defines it; resolved on first access (PEP 562)
_LAZY = {
    "Cluster": "nbtrain.cluster.facade",
    "ClusterPicker": "nbtrain.display.picker",
    "ConfigError": "nbtrain.errors",
    "DPOConfig": "nbtrain.configs.dpo",
    "DistributedCellError": "nbtrain.errors",
    "GRPOConfig": "nbtrain.configs.grpo",
    "Hooks": "nbtrain.recipes.hooks",
    "Preempted": "nbtrain.engine.signals.preempt",
    "Run": "nbtrain.recipes.steppable",
    "attach": "nbtrain.cluster.api",
    "check": "nbtrain.cluster.check",
    # what each path does with a model, from its config alone (twin of %nbtrain check --model)
    "check_model": "nbtrain.model.report",
    # the module itself, which is callable: nbtrain.compare([...]) draws, nbtrain.compare.load_run reads
    "compare": "nbtrain.compare",
    "connect": "nbtrain.cluster.api",
    "current_cluster": "nbtrain.cluster.facade",
    "start": "nbtrain.cluster.api",
    "scaling": "nbtrain.cluster.api",
    # the Tinker-compatible service: serve_tinker(cluster=None) serves in this kernel (issue 36)
    "serve_tinker": "nbtrain.tinker.kernel.serve",
    "tinker_url": "nbtrain.tinker.kernel.serve",
    # the debug log's switch, twin of NBTRAIN_LOG=debug and %nbtrain log debug
    "set_log_level": "nbtrain.logs",
    "SFTConfig": "nbtrain.configs.sft",
    "TrainResult": "nbtrain.recipes.train",
    "finetune": "nbtrain.recipes.train",
    "generate": "nbtrain.generation.generate",
    "log": "nbtrain.engine.metrics",
    "log_end": "nbtrain.engine.metrics",
    "is_rank_zero": "nbtrain.engine.rank",
}

if TYPE_CHECKING:
    from nbtrain.cluster.api import attach, connect, scaling, start
    from nbtrain.cluster.check import check
    from nbtrain.cluster.facade import Cluster, current_cluster
    from nbtrain.compare import compare
    from nbtrain.configs.dpo import DPOConfig
    from nbtrain.configs.grpo import GRPOConfig
    from nbtrain.configs.sft import SFTConfig
    from nbtrain.display.picker import ClusterPicker
    from nbtrain.engine.metrics import log, log_end
    from nbtrain.engine.rank import is_rank_zero
    from nbtrain.engine.signals.preempt import Preempted
    from nbtrain.errors import ConfigError, DistributedCellError
    from nbtrain.generation.generate import generate
    from nbtrain.logs import set_log_level
    from nbtrain.model.report import check_model
    from nbtrain.recipes.steppable import Run
    from nbtrain.recipes.train import TrainResult, finetune
    from nbtrain.tinker.kernel.serve import serve_tinker, tinker_url


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        msg = f"module 'nbtrain' has no attribute {name!r}"
        raise AttributeError(msg)
    imported = importlib.import_module(module)
    value = imported if module == f"nbtrain.{name}" else getattr(imported, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


def _live_display() -> Any:
    from nbtrain.live import LiveDisplay

    return LiveDisplay()


# nbtrain.log() in a plain kernel draws the live display; engine code only knows the sink it is given
_metrics.set_local_sink(_live_display)

# NBTRAIN_LOG=debug (info, warning) shows nbtrain's log on stderr from the first import on
_logs.from_env()


def load_ipython_extension(ipython: Any) -> None:
    """Register the %nbtrain line magic and the %%distributed cell magic."""
    from nbtrain.magics import register

    register(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """Nothing to undo beyond what IPython does itself; clusters stay running."""
