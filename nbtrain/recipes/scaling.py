"""One size of a scaling run (`%nbtrain scaling`), on the engines: probe the sub-group's all-reduce,
then the short `finetune` on it with its gradient all-reduce timed (nbtrain.telemetry.commtime)."""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from nbtrain.telemetry import commtime

log = logging.getLogger(__name__)


def _device_name() -> str:
    import torch

    planned = os.environ.get("NBTRAIN_DEVICE", "")
    if planned.startswith("cuda") or (not planned and torch.cuda.is_available()):
        return torch.cuda.get_device_name()
    model = ""
    try:
        for line in open("/proc/cpuinfo").read().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU {model or 'unknown'} ({os.cpu_count()} cores)"


def run_size(
    ranks: list[int],
    cfg_dict: dict[str, Any],
    probe_iters: int,
) -> dict[str, Any] | None:
    """One size of a scaling run, called on every rank of the world at once (a new group is a
    collective of the world): the ranks in `ranks` fine-tune on their sub-group with the gradient
    all-reduce timed, then probe the sub-group's all-reduce latency (4 bytes) and its bandwidth at the
    gradients' own size; the others only take part in making the group."""
    import torch.distributed as dist

    from nbtrain.configs.sft import SFTConfig
    from nbtrain.engine.probe import allreduce_times
    from nbtrain.recipes.train import finetune

    group = dist.new_group(sorted(ranks)) if dist.is_initialized() else None
    me = dist.get_rank() if dist.is_initialized() else 0
    if me not in ranks:
        return None
    try:
        with commtime.timing() as timer:
            result = finetune(SFTConfig(**cfg_dict), group=group)
        sizes = [4, max(4, timer.grad_bytes // 4 * 4)]
        probed = allreduce_times(sizes, probe_iters, group=group) if len(ranks) > 1 else []
        return {
            "rank": me,
            "host": socket.gethostname(),
            "device": _device_name(),
            "history": result.history.to_dict(orient="records"),
            "plan": result.plan,
            "comm": timer.steps(),
            "grad_bytes": timer.grad_bytes,
            "probe": probed,
        }
    finally:
        if group is not None:
            try:
                dist.destroy_process_group(group)
            except Exception:  # a shim that keeps groups; nothing to free
                pass
