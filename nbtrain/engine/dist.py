"""The process group as one fine-tuning run sees it: rank, world, device, and the few collectives
`finetune` needs, each of which also works alone (world size 1)."""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from nbtrain.engine.rank import get_local_rank, get_rank, get_world_size
from nbtrain.errors import ConfigError

log = logging.getLogger(__name__)


class Dist:
    """The process group as this run sees it; every method also works alone (world size 1)."""

    def __init__(self, group: Any = None) -> None:
        """`group`: a sub-group of the running process group to train on (its ranks become this run's
        ranks 0..n-1); None for the whole world, as before."""
        import torch
        import torch.distributed as dist

        self.dist = dist
        world = get_world_size()
        # on an nbtrain engine the client planned the device for every rank (NBTRAIN_DEVICE); else
        # (torchrun) a GPU only where every rank on this host gets its own, never two on one GPU
        planned = os.environ.get("NBTRAIN_DEVICE")
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        own_gpu = torch.cuda.is_available() and local_world <= torch.cuda.device_count()
        if world > 1 and not dist.is_initialized():
            # launched by torchrun or by hand: nbtrain's cluster would have set the group up already
            backend = "nccl" if own_gpu else "gloo"
            dist.init_process_group(backend=backend, init_method="env://")
        self.group = _member_group(dist, group)
        self.active = (
            dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1
        )
        self.rank = dist.get_rank(self.group) if self.active else get_rank()
        self.world = dist.get_world_size(self.group) if self.active else 1
        # broadcasts name their source by its rank in the world group
        self.src = dist.get_global_rank(self.group, 0) if self.active and group is not None else 0
        if self.world == 1:
            self.rank = 0
        self.local_rank = get_local_rank()
        if planned:
            self.device = torch.device(planned)
        elif own_gpu:
            self.device = torch.device("cuda", self.local_rank)
        else:
            if torch.cuda.is_available():
                import sys

                print(
                    f"nbtrain: {local_world} ranks on {socket.gethostname()} but "
                    f"{torch.cuda.device_count()} GPU(s): training on CPU; start one rank per GPU.",
                    file=sys.stderr,
                )
            self.device = torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        backend = dist.get_backend(self.group) if self.active else "gloo"
        self.comm_device = self.device if backend == "nccl" else torch.device("cpu")
        # the step's small bookkeeping (token counts, stop flag, logged figures) goes over gloo on the
        # CPU: over NCCL it would have to wait for the GPU, a host synchronisation in every step
        self.meta_group = (
            cpu_group(dist, self.group) if self.active and backend == "nccl" else self.group
        )
        self.host = socket.gethostname()

    @property
    def is_zero(self) -> bool:
        # the one rank-0 flag (nbtrain.is_rank_zero reads the env; the group is the truth here)
        return self.rank == 0

    def sum_(self, t: Any) -> Any:
        """All-reduce (sum) a tensor in place; returns it on the compute device's side of comms."""
        if self.active:
            moved = t.to(self.comm_device)
            self.dist.all_reduce(moved, group=self.group)
            return moved.to(t.device)
        return t

    def sum_meta(self, t: Any) -> Any:
        """All-reduce (sum) a small CPU tensor in place without waiting for the GPU."""
        if self.active:
            self.dist.all_reduce(t, group=self.meta_group)
        return t

    def gather_objects(self, obj: Any) -> list[Any]:
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world
        self.dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        if not self.active:
            return obj
        box = [obj]
        self.dist.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]

    def min_int(self, value: int) -> int:
        import torch

        if not self.active:
            return value
        t = torch.tensor([value], dtype=torch.long, device=self.comm_device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def barrier(self) -> None:
        if self.active:
            self.dist.barrier(group=self.group)

    def agree(self, fn: Any) -> Any:
        """Run a set-up phase on every rank; if it fails on any rank, raise on all of them, not hang."""
        err: BaseException | None = None
        value = None
        try:
            value = fn()
        except Exception as e:  # carried to every rank below, which raise it together
            err = e
        report = (
            None if err is None else (type(err).__name__, str(err), isinstance(err, ConfigError))
        )
        reports = self.gather_objects((report, self.host))
        if err is not None:
            raise err
        failed = [(r, rep, host) for r, (rep, host) in enumerate(reports) if rep is not None]
        if failed:
            r, (kind, text, is_config), host = failed[0]
            msg = f"rank {r} on {host} failed during set-up: {text}"
            raise ConfigError(msg) if is_config else RuntimeError(f"{kind}: {msg}")
        return value


def _member_group(dist: Any, group: Any) -> Any:
    """The process group to train on: None (the world) or a sub-group this rank belongs to."""
    if group is None:
        return None
    if not dist.is_initialized():
        msg = "finetune(group=...) needs the process group initialized on this rank (an nbtrain cluster)"
        raise ConfigError(msg)
    if group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(group) < 0:
        msg = (
            f"finetune(group=...): rank {dist.get_rank()} is not a member of that group; run "
            "finetune only on the group's ranks (%%distributed --group NAME)"
        )
        raise ConfigError(msg)
    return group


_CPU_GROUP: list[Any] = []  # [the group it was made for, the gloo group]


def cpu_group(dist: Any, group: Any = None) -> Any:
    """A gloo group over every rank of `group` (the default group when None), made once per group
    (the group is held here, so a re-created one is never mistaken for it).

    A sub-group's gloo twin is made among its members alone (`use_local_synchronization`), so the
    ranks outside it need not take part."""
    base = dist.distributed_c10d._get_default_group() if group is None else group
    if not _CPU_GROUP or _CPU_GROUP[0] is not base:
        if group is None:
            made = dist.new_group(backend="gloo")
        else:
            ranks = dist.get_process_group_ranks(group)
            made = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        _CPU_GROUP[:] = [base, made]
    return _CPU_GROUP[1]
