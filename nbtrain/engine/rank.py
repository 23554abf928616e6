"""This rank's identity, read from the torchrun-style environment nbtrain sets on each engine."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def get_rank() -> int:
    """The global torch rank of this process (0 in a plain process)."""
    return int(os.environ.get("RANK", "0"))


def get_world_size() -> int:
    """How many ranks take part (1 in a plain process)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def get_local_rank() -> int:
    """The rank of this process on its host (0 in a plain process)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_rank_zero() -> bool:
    """True on the one rank that logs, checkpoints and exports (rank 0, or a plain process)."""
    return get_rank() == 0
