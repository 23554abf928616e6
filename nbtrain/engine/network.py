"""Network questions the client asks each engine while it sets up a multi-node process group.

Each function runs on an engine (through `apply`) and returns plain data. Cheap to import: the
standard library and psutil only.
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)


def route(target: str) -> dict[str, Any]:
    """How this host reaches `target`: this host's source address and the interface it leaves by."""
    from nbtrain import net

    r = net.route_to(target)
    return {"address": r.source, "interface": r.interface, "local": r.local, "target": r.address}


def port_in_use(port: int) -> bool:
    """True when a listener cannot bind TCP `port` on this host (the rendezvous port is taken)."""
    from nbtrain import net

    return net.port_in_use(port)


def set_env(env: dict[str, str]) -> None:
    """Put `env` into this engine's environment (read later by torch.distributed, gloo and NCCL)."""
    os.environ.update(env)


def launch_host() -> str | None:
    """The `--hosts` entry this engine was started for over SSH (set by nbtrain's launcher)."""
    return os.environ.get("NBTRAIN_LAUNCH_HOST")


# the launcher's own number for this process: Slurm's task id, or the MPI rank (Open MPI, MPICH and
# Intel MPI, PMIx); nbtrain orders hosts and a host's engines by it, and numbers ranks itself
# set by launchers that number their engines themselves (Ray: in placement order)
TASK_ENV = "NBTRAIN_LAUNCH_TASK"
_TASK_VARS = (TASK_ENV, "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")


def launch_slot() -> dict[str, Any]:
    """Where the launcher put this engine: its label (the --hosts entry over SSH, the Slurm node
    name) and its task id (Slurm task or MPI rank), None where the launcher sets none."""
    task = None
    for name in _TASK_VARS:
        value = os.environ.get(name, "")
        if value.isdigit():
            task = int(value)
            break
    label = os.environ.get("NBTRAIN_LAUNCH_HOST") or os.environ.get("SLURMD_NODENAME") or None
    return {"label": label, "task": task}
