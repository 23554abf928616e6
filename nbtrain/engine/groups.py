"""Named sub-groups of the process group, on each engine: `groups` and `group` in the cell namespace.

The client (`nbtrain.cluster.group.define`) calls `define` on every rank at once with the same
definitions in the same order, because `torch.distributed.new_group` is a collective of the whole
world: every rank creates every group, members or not. A rank outside a group gets what
`new_group` returns there, `torch.distributed.GroupMember.NON_GROUP_MEMBER` (not a process group);
`groups.member(name)` says which it is.

`enter` sets `group`, the process group of the cell about to run: its `--group`, or the world
group (`torch.distributed.group.WORLD`) for a cell without one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)


class Groups(dict[str, Any]):
    """`groups` in a `%%distributed` cell: name -> this rank's handle of that group.

    The handle is the group's `ProcessGroup` on its member ranks and
    `torch.distributed.GroupMember.NON_GROUP_MEMBER` on the others. `groups.ranks[name]` are the
    group's world ranks; `groups.member(name)` says whether this rank is one of them.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ranks: dict[str, list[int]] = {}

    def member(self, name: str) -> bool:
        """Whether this rank belongs to group `name`."""
        import torch.distributed as dist

        return dist.get_rank() in self._known(name)

    def _known(self, name: str) -> list[int]:
        if name not in self.ranks:
            defined = ", ".join(self.ranks) or "none"
            msg = f"no group named {name!r} on this rank (defined: {defined})"
            raise KeyError(msg)
        return self.ranks[name]

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}: ranks {r}" for n, r in self.ranks.items())
        return f"<nbtrain groups {{{inner}}}>"


GROUPS = Groups()


def _user_ns() -> dict[str, Any]:
    from IPython import get_ipython

    ip = get_ipython()
    return ip.user_ns if ip is not None else {}


def _world() -> Any:
    import torch.distributed as dist

    return dist.group.WORLD


def _drop_old() -> None:
    """Destroy this rank's handles of the previous groups (those a re-init left are gone already)."""
    import torch.distributed as dist

    for pg in GROUPS.values():
        if pg is None or pg is dist.GroupMember.NON_GROUP_MEMBER:
            continue
        try:
            # nbtrain's shim keeps the world group but passes sub-groups on to torch; a local step
            dist.destroy_process_group(pg)
        except Exception:  # destroyed with the old world group by a re-init
            pass
    GROUPS.clear()
    GROUPS.ranks.clear()


def define(specs: Sequence[tuple[str, Sequence[int]]]) -> dict[str, Any]:
    """Replace this rank's groups with `specs` (name, world ranks), created in that order.

    Called on every rank at once: `new_group` waits until every rank of the world has called it.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        msg = "the process group is not initialized on this rank; restart the cluster (%nbtrain restart)"
        raise RuntimeError(msg)
    _drop_old()
    for name, ranks in specs:
        members = sorted(int(r) for r in ranks)
        # the name as torch's group description: the flight recorder labels the group's collectives
        # with it, and `%nbtrain diagnose` names the group from it
        GROUPS[name] = dist.new_group(members, group_desc=name)
        GROUPS.ranks[name] = members
    ns = _user_ns()
    ns["groups"] = GROUPS
    ns["group"] = _world()
    rank = dist.get_rank()
    return {"rank": rank, "member_of": [n for n, r in GROUPS.ranks.items() if rank in r]}


def sequence_numbers() -> dict[str, int | None]:
    """The collectives so far in each group this rank belongs to (None where torch does not count)."""
    import torch.distributed as dist

    out: dict[str, int | None] = {}
    for name, pg in GROUPS.items():
        if pg is None or pg is dist.GroupMember.NON_GROUP_MEMBER:
            continue
        try:
            out[name] = int(pg._get_sequence_number_for_group())
        except Exception:  # older torch, a backend that does not count, a destroyed group
            out[name] = None
    return out


def enter(name: str | None) -> None:
    """Set `group` for the cell about to run: group `name`'s handle, or the world group."""
    ns = _user_ns()
    ns["groups"] = GROUPS
    if name is None:
        ns["group"] = _world()
        return
    GROUPS._known(name)
    ns["group"] = GROUPS[name]
