"""Many ranks failing at once, told as one message: identical failures shown once, with their ranks.

A primitive on the rank table (`topology`), no client: used by every call that gathers results from
the ranks (`Session.run`, `%%distributed` cells).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from nbtrain.cluster.ranks.topology import RankInfo, describe_ranks
from nbtrain.engine import oom
from nbtrain.errors import ClusterError, DistributedCellError, NbtrainError

log = logging.getLogger(__name__)

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# a cell's name in a traceback differs by rank with each rank's execution count ("Cell In[18]" on a
# rank that ran more cells alone, --ranks): the same failure all the same
_CELL_FILE = re.compile(r"ipykernel_\d+/\d+\.py|<ipython-input-\d+-[0-9a-f]+>|Cell In\[\d+\]")


def _normalise(text: str) -> str:
    return _CELL_FILE.sub("<cell>", _ANSI.sub("", text))


def raise_for_failures(
    ranks: Sequence[RankInfo], which: Sequence[int], results: Sequence[Any], note: str = ""
) -> None:
    """Raise one `DistributedCellError` grouping identical remote failures, if any rank failed."""
    failures = []
    for r, res in zip(which, results):
        if isinstance(res, BaseException):
            failures.append((r, res))
    if failures:
        message, groups = group_failures(ranks, failures, total=len(which))
        raise DistributedCellError(message + note, groups)


def group_failures(
    ranks: Sequence[RankInfo], failures: Sequence[tuple[int, BaseException]], total: int
) -> tuple[str, list[dict[str, Any]]]:
    """One message for many failing ranks: identical failures are shown once with all their ranks."""
    groups: dict[tuple[str, str, str], dict[str, Any]] = {}
    for rank, err in failures:
        ename = getattr(err, "ename", type(err).__name__)
        evalue = str(getattr(err, "evalue", err))
        tb = getattr(err, "traceback", None)
        if isinstance(tb, list):
            tb = "\n".join(tb)
        if not tb and hasattr(err, "render_traceback"):
            tb = "\n".join(err.render_traceback())
        tb = tb or f"{ename}: {evalue}"
        is_oom = oom.is_oom(ename, evalue)
        if is_oom:
            # every rank's message has its own sizes, GPU and host: the same code running out of
            # memory is one failure, keyed by the frames above the message
            key = (ename, "out of memory", _normalise(tb).split("out of memory")[0])
        else:
            key = (ename, _normalise(evalue), _normalise(tb))
        group = groups.setdefault(
            key, {"ename": ename, "evalue": evalue, "traceback": tb, "ranks": [], "oom": is_oom}
        )
        group["ranks"].append(rank)
        group.setdefault("evalues", {})[rank] = evalue
    n_failed = len(failures)
    head = f"the cell failed on {n_failed} of {total} rank(s)"
    parts = [head]
    for g in groups.values():
        where = describe_ranks(ranks, g["ranks"])
        # the ranks on the message's first line, where a reader looks for them, not after its last
        first, *rest = f"{g['ename']}: {g['evalue']}".split("\n")
        text = "\n".join([f"{first}  [{where}]", *rest])
        tb = _without_message(g["traceback"], g["ename"], g["evalue"])
        parts.append(f"\n{text}" + (f"\n{tb}" if tb else ""))
        footer = _oom_footer(ranks, g) if g["oom"] else ""
        if footer:
            parts.append(footer)
    return "\n".join(parts), list(groups.values())


def _without_message(tb: str, ename: str, evalue: str) -> str:
    """The remote traceback without its last lines where they repeat the message shown above it
    (all of it for nbtrain's own errors, whose traceback is their message)."""
    lines = tb.rstrip().split("\n")
    message = f"{ename}: {evalue}".rstrip().split("\n")
    tail = [_ANSI.sub("", ln).rstrip() for ln in lines[-len(message) :]]
    if len(lines) >= len(message) and tail == [ln.rstrip() for ln in message]:
        lines = lines[: -len(message)]
    return "\n".join(lines).rstrip()


def _oom_footer(ranks: Sequence[RankInfo], group: dict[str, Any]) -> str:
    """Under a group of ranks that ran out of GPU memory: each rank's sizes, and the fixes if the engine
    did not add them (an engine without nbtrain's hook)."""
    lines = []
    if len(group["ranks"]) > 1:
        lines.append("Out of GPU memory on each rank:")
        lines.extend(
            f"  {describe_ranks(ranks, [r])}: {oom.summary(group['evalues'][r])}"
            for r in group["ranks"]
        )
    if oom.MARK not in group["evalue"]:
        lines.append(oom.FIXES)
    return "\n".join(lines)


def start_failed(step: str, error: BaseException) -> BaseException:
    """What a launcher raises once it has torn down a start that failed while `step`.

    nbtrain's own errors and Ctrl-C go through as they are; anything else becomes a ClusterError
    that names the step (the launcher has already left nothing running).
    """
    if isinstance(error, (NbtrainError, KeyboardInterrupt)):
        return error
    msg = f"starting the cluster failed while {step}: {type(error).__name__}: {error}. Nothing was left running."
    return ClusterError(msg)
