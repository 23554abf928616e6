"""How many rows a micro-batch holds, and how many micro-batches make an optimizer step.

`per_device_train_batch_size="auto"` finds the largest micro-batch that fits, once, before training:
one forward and backward at 1 and at 2 rows of `max_length` tokens give the memory a row costs and
what the model costs on its own; the largest batch that stays under the budget is then tried for real,
and halved while it runs out of memory. On a GPU the figures are the allocator's peak and the card's
memory; on the CPU, the process's peak resident memory and the memory available to this rank.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nbtrain.errors import ConfigError

log = logging.getLogger(__name__)

# never more rows per micro-batch than this: past it a bigger batch buys no speed
MAX_AUTO_BATCH = 64
# share of the memory the planner lets a micro-batch use: room for fragmentation and the optimizer
BUDGET_SHARE = 0.85


@dataclass
class BatchPlan:
    """Micro-batch size, accumulation steps and the global batch they make, and how it was chosen."""

    micro_batch: int
    grad_accum: int
    global_batch: int
    note: str = ""


def split_global(global_batch: int, world: int, micro: int) -> int:
    """Accumulation steps that make `global_batch` from `world` ranks of `micro` rows, or a ConfigError."""
    if global_batch % (world * micro):
        msg = (
            f"global_batch_size={global_batch} cannot be split into {world} rank(s) x "
            f"per_device_train_batch_size {micro}: it must be a multiple of {world * micro}. Pick a "
            f"global batch that is, or per_device_train_batch_size='auto'"
        )
        raise ConfigError(msg)
    return global_batch // (world * micro)


def fixed_plan(per_device: int, grad_accum: int, global_batch: int | None, world: int) -> BatchPlan:
    """The plan when the micro-batch is given: accumulation from `global_batch_size` where set."""
    if global_batch is None:
        return BatchPlan(per_device, grad_accum, world * per_device * grad_accum)
    if grad_accum != 1 and grad_accum * world * per_device != global_batch:
        msg = (
            f"gradient_accumulation_steps={grad_accum} and global_batch_size={global_batch} disagree "
            f"({world} rank(s) x {per_device} rows x {grad_accum} = {world * per_device * grad_accum}); "
            "give one of them"
        )
        raise ConfigError(msg)
    return BatchPlan(per_device, split_global(global_batch, world, per_device), global_batch)


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def largest_divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


# ------------------------------------------------------------------------------------- measuring
def _is_oom(err: BaseException) -> bool:
    import torch

    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def _rss_peak_reset() -> bool:
    """Reset this process's peak resident memory (VmHWM); False where the kernel does not let us."""
    try:
        with open(f"/proc/{os.getpid()}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rss_peak() -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class MemoryProbe:
    """Runs `step(rows)` (one forward and backward of `rows` rows) and reports the peak memory it took."""

    def __init__(self, step: Callable[[int], None], device: Any, local_world: int = 1):
        import torch

        self.step, self.device = step, device
        self.on_gpu = device.type == "cuda"
        if self.on_gpu:
            free, total = torch.cuda.mem_get_info(device)
            # what this process holds already is ours to count on too
            self.budget = int((free + torch.cuda.memory_reserved(device)) * BUDGET_SHARE)
            self.total = total
        else:
            import psutil

            self.budget = int(
                psutil.virtual_memory().available / max(1, local_world) * BUDGET_SHARE
            )
            self.total = psutil.virtual_memory().total
            if not _rss_peak_reset():
                msg = "cannot measure memory here (no /proc/self/clear_refs): pass per_device_train_batch_size as a number"
                raise ConfigError(msg)

    def peak(self, rows: int) -> int:
        """Peak memory of one step with `rows` rows; raises the out-of-memory error if it does not fit."""
        import torch

        gc.collect()
        if self.on_gpu:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.step(rows)
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.max_memory_allocated(self.device))
        _rss_peak_reset()
        self.step(rows)
        return _rss_peak()


def auto_plan(
    probe: MemoryProbe,
    *,
    world: int,
    rows_per_rank: int,
    grad_accum: int,
    global_batch: int | None,
    agree: Callable[[int], int] = lambda b: b,
    shard_size: int = 1,
) -> BatchPlan:
    """The largest micro-batch that fits (the same on every rank through `agree`, a min across ranks).

    `shard_size` > 1: the model is sharded over that many ranks (FSDP), so the probes measure its
    weights/N share; every probe step then runs collectives, so the guess is not tried for real (an
    out-of-memory on one rank alone would leave the others waiting) but kept a tenth under the budget.
    """
    import torch

    cap = min(MAX_AUTO_BATCH, max(1, rows_per_rank))
    if global_batch is not None:
        if global_batch % world:
            msg = f"global_batch_size={global_batch} is not a multiple of the {world} rank(s); pick one that is"
            raise ConfigError(msg)
        cap = largest_divisor_at_most(global_batch // world, cap)
    try:
        one = probe.peak(1)
    except Exception as e:
        if not _is_oom(e):
            raise
        msg = (
            f"one row of max_length tokens does not fit in memory ({probe.budget / 2**30:.1f} GiB usable): "
            "lower max_length, or set gradient_checkpointing=True"
        )
        raise ConfigError(msg) from None
    two = probe.peak(2) if cap >= 2 else one
    per_row = max(two - one, 1)
    budget = probe.budget * (0.9 if shard_size > 1 else 1.0)
    fits = int((budget - (one - per_row)) // per_row)
    guess = max(1, min(cap, fits))
    if global_batch is not None:
        guess = largest_divisor_at_most(global_batch // world, guess)
    # the straight line is a guess (allocators round, kernels pick workspaces): try it for real
    micro = guess
    while micro > 1 and shard_size == 1:
        try:
            probe.peak(micro)
            break
        except Exception as e:
            if not _is_oom(e):
                raise
            if probe.on_gpu:
                torch.cuda.empty_cache()
            micro = micro // 2
            if global_batch is not None:
                micro = largest_divisor_at_most(global_batch // world, micro)
    micro = agree(micro)
    accum = grad_accum if global_batch is None else split_global(global_batch, world, micro)
    note = (
        f"auto batch: {micro} row(s) per micro-batch x {accum} accumulation step(s) "
        f"(one row {_size(per_row)}, the model {_size(max(one - per_row, 0))}"
        f"{f' sharded over {shard_size} ranks' if shard_size > 1 else ''}, "
        f"{_size(probe.budget)} usable)"
    )
    return BatchPlan(micro, accum, world * micro * accum, note)
