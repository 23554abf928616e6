"""Disaggregated GRPO's traffic between the rank groups: one process group spanning the actor and the
rollout group, over which the rollout's scored completions go to the actor (from rollout rank 0) and,
after each optimizer step, the LoRA weights go to the rollout (one broadcast from actor rank 0: every
trainable tensor flattened into one, with a flag saying whether another step follows).

The groups are the named groups `%nbtrain groups` made (`nbtrain.engine.groups.GROUPS`).
"""

from __future__ import annotations

import logging
from typing import Any

from nbtrain.errors import ConfigError

log = logging.getLogger(__name__)


def resolve(actor: str, rollout: str) -> tuple[list[int], list[int], Any, Any]:
    """(actor ranks, rollout ranks, actor group, rollout group) of the named groups; a ConfigError
    naming what is missing or wrong."""
    import torch.distributed as dist

    from nbtrain.engine.groups import GROUPS

    if not dist.is_initialized():
        msg = "GRPOConfig(actor=..., rollout=...) needs a cluster with rank groups (%nbtrain groups actor=0 rollout=1)"
        raise ConfigError(msg)
    missing = [n for n in (actor, rollout) if n not in GROUPS.ranks]
    if missing:
        defined = ", ".join(GROUPS.ranks) or "none"
        msg = (
            f"no rank group named {missing[0]!r} (defined: {defined}); make them first, e.g. "
            f"%nbtrain groups {actor}=0 {rollout}=1"
        )
        raise ConfigError(msg)
    a, r = GROUPS.ranks[actor], GROUPS.ranks[rollout]
    both = sorted(set(a) & set(r))
    if both:
        msg = (
            f"groups {actor!r} ({a}) and {rollout!r} ({r}) share rank(s) {both}; disaggregated GRPO needs "
            "groups with no rank in common (leave actor and rollout out for collocated GRPO)"
        )
        raise ConfigError(msg)
    me = dist.get_rank()
    if me not in a and me not in r:
        msg = f"rank {me} is in neither {actor!r} ({a}) nor {rollout!r} ({r}); run the cell on those ranks only"
        raise ConfigError(msg)
    return list(a), list(r), GROUPS[actor], GROUPS[rollout]


class Link:
    """The process group over both groups' ranks (the world where they are all of it)."""

    def __init__(self, actor_ranks: list[int], rollout_ranks: list[int]) -> None:
        import torch
        import torch.distributed as dist

        self.dist = dist
        self.actor0, self.rollout0 = actor_ranks[0], rollout_ranks[0]
        ranks = sorted(actor_ranks + rollout_ranks)
        if ranks == list(range(dist.get_world_size())):
            self.group = None
        else:  # made by its members alone, so the ranks outside take no part
            self.group = dist.new_group(ranks, use_local_synchronization=True)
        backend = dist.get_backend(self.group)
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )

    def object(self, obj: Any, src: int) -> Any:
        """`obj` from world rank `src` to every rank of both groups."""
        box = [obj]
        self.dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.dist.get_world_size(self.group)
        self.dist.all_gather_object(out, obj, group=self.group)
        return out

    def weights(self, params: list[Any], more: bool, mode: str) -> bool:
        """The trainable tensors from actor rank 0 (`mode` "send") into every rollout rank's ("load");
        the actor's other ranks take part and keep theirs ("keep"). One broadcast; returns the flag
        actor rank 0 sent: whether another step follows."""
        import torch

        n = sum(p.numel() for p in params)
        flat = torch.empty(n + 1, dtype=torch.float32, device=self.device)
        if mode == "send":
            flat[:n] = torch.cat([p.detach().reshape(-1).float().to(self.device) for p in params])
            flat[n] = 1.0 if more else 0.0
        self.dist.broadcast(flat, src=self.actor0, group=self.group)
        if mode == "load":
            at = 0
            with torch.no_grad():
                for p in params:
                    p.copy_(flat[at : at + p.numel()].view_as(p).to(p.dtype))
                    at += p.numel()
        return bool(flat[n].item() > 0.5)
