"""Errors nbtrain raises in the notebook. Each names what failed, where (rank, host) and the fix."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class NbtrainError(Exception):
    """Base class for nbtrain's own errors."""

    def _render_traceback_(self) -> list[str]:
        # IPython shows this instead of a traceback into nbtrain's internals: the message is the point
        return f"{type(self).__name__}: {self}".splitlines()


class ClusterError(NbtrainError):
    """A cluster could not be started, reached or used."""


class NoClusterError(ClusterError):
    """A distributed cell ran before any cluster was started."""


class DistributedCellError(NbtrainError):
    """A `%%distributed` cell raised on one or more ranks.

    The message groups identical failures, naming each group's ranks and hosts, the exception and the
    remote traceback once.
    """

    def __init__(self, message: str, failures: list[dict] | None = None):
        super().__init__(message)
        self.failures = failures or []


class CellTimeoutError(DistributedCellError):
    """A `%%distributed --timeout S` cell ran past S seconds; the message holds every rank's stack."""


class ConfigError(NbtrainError, ValueError):
    """A setting is invalid; raised before any engine or step runs."""


class RankDiedError(DistributedCellError):
    """A rank died (killed, crashed, exited, or its node was lost) while a cell ran.

    `deaths` holds one `nbtrain.cluster.faults.recovery.RankDeath` per dead rank: rank, host, how, stderr tail.
    """

    def __init__(self, message: str, deaths: list | None = None):
        super().__init__(message, [])
        self.deaths = deaths or []


class NotARunError(NbtrainError, FileNotFoundError):
    """A folder given as a run holds no run (no metrics.jsonl that `finetune` writes)."""
