"""What makes an engine look like a torchrun worker to the libraries that run in it.

torchrun's environment itself is set by the client (`nbtrain.cluster.ranks.topology.torchrun_env`, applied by
`setup.init_rank`). Here, in the engine: it must not look like an interactive prompt (IPython sets
`sys.ps1`, and Lightning refuses `strategy="ddp"` in an interactive process), and code that makes or
ends the process group itself must find nbtrain's group and leave it for the next cell.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from typing import Any

log = logging.getLogger(__name__)

# the real torch functions, kept before the shims replace them
_REAL: dict[str, Any] = {}
_NOTED: set[str] = set()


def not_interactive() -> None:
    """Drop the prompts IPython put in `sys` (Lightning's `_IS_INTERACTIVE` is `hasattr(sys, "ps1")`).

    IPython sets them only so that scripts can tell they run at a prompt; nothing on an engine reads
    them, and an engine runs cells for a script-like rank, not for a person at a prompt.
    """
    for name in ("ps1", "ps2", "ps3"):
        if hasattr(sys, name):
            delattr(sys, name)


def _note_once(key: str, text: str) -> None:
    if key not in _NOTED:
        _NOTED.add(key)
        print(f"nbtrain: {text}", file=sys.stderr)


def real(name: str) -> Any:
    """torch's own `init_process_group` / `destroy_process_group` (`name` is "init" or "destroy")."""
    import torch.distributed.distributed_c10d as c10d

    return _REAL.get(name) or getattr(c10d, f"{name}_process_group")


def install_shims() -> None:
    """Let code written for torchrun run unchanged although nbtrain already made the group.

    Such code calls `init_process_group()` first and often `destroy_process_group()` last. On an
    nbtrain engine the first finds the group ready (a no-op if the backend agrees) and the second
    leaves it in place, so the next cell still has a working group.
    """
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if "init" in _REAL:
        return
    _REAL["init"] = c10d.init_process_group
    _REAL["destroy"] = c10d.destroy_process_group

    def init_process_group(backend: Any = None, *args: Any, **kwargs: Any) -> None:
        if dist.is_initialized():
            current = str(dist.get_backend())
            if backend is None or current in str(backend).lower():
                _note_once(
                    "init",
                    "the process group is already set up by nbtrain; init_process_group() kept it.",
                )
                return None
            msg = (
                f"rank {os.environ.get('RANK')} on {socket.gethostname()}: this code asks for backend "
                f"{backend!r}, but nbtrain's process group uses {current!r}. Restart the cluster with "
                f"%nbtrain start --force --backend {backend}."
            )
            raise RuntimeError(msg)
        return _REAL["init"](backend, *args, **kwargs)

    def destroy_process_group(group: Any = None) -> None:
        if group is None or group is c10d.GroupMember.WORLD:
            _note_once(
                "destroy",
                "kept nbtrain's process group for the next cell (destroy_process_group() is a no-op here).",
            )
            return None
        return _REAL["destroy"](group)

    for module in (dist, c10d):
        setattr(module, "init_process_group", init_process_group)  # noqa: B010
        setattr(module, "destroy_process_group", destroy_process_group)  # noqa: B010
