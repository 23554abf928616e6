"""Many ranks failing at once told as one message (nbtrain/cluster/failures.py), on plain errors
shaped as ipyparallel's RemoteError (ename, evalue, traceback), no engines."""

from __future__ import annotations

from nbtrain.cluster.failures import group_failures
from nbtrain.cluster.ranks.topology import RankInfo

RANKS = [
    RankInfo(rank=r, engine_id=r, host="vm", local_rank=r, local_world_size=2, pid=r)
    for r in (0, 1)
]


class Remote(Exception):
    def __init__(self, cell: int, evalue: str = "division by zero"):
        super().__init__(evalue)
        self.ename, self.evalue = "ZeroDivisionError", evalue
        # as IPython 8 writes a cell's frame, ANSI colours included, numbered by the rank's own count
        self.traceback = [
            "\x1b[31mZeroDivisionError\x1b[39m   Traceback (most recent call last)",
            f"\x1b[36mCell\x1b[39m\x1b[36m \x1b[39m\x1b[32mIn[{cell}]\x1b[39m\x1b[32m, line 1\x1b[39m",
            "----> 1 1/0",
            f"ZeroDivisionError: {evalue}",
        ]


def test_the_same_failure_in_cells_numbered_apart_is_one_group():
    # rank 1 ran 16 more cells of its own (%%distributed --ranks 1): the same 1/0 all the same
    message, groups = group_failures(RANKS, [(0, Remote(2)), (1, Remote(18))], total=2)
    assert len(groups) == 1 and groups[0]["ranks"] == [0, 1], message
    assert message.count("division by zero") == 1 and "ranks 0-1 on vm" in message


def test_different_failures_stay_apart():
    _, groups = group_failures(RANKS, [(0, Remote(2)), (1, Remote(2, "other"))], total=2)
    assert [g["ranks"] for g in groups] == [[0], [1]]
