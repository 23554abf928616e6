"""`%nbtrain groups`: named sub-groups of the process group. Thin: parse, call the API, print."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from nbtrain.errors import ConfigError

log = logging.getLogger(__name__)


def add_group_commands(sub: Any) -> None:
    """`%nbtrain groups [NAME=RANKS ...] [--clear]`."""
    p = sub.add_parser(
        "groups",
        help="define named sub-groups of the process group (actor=0-3 rollout=4-7); none: list them",
    )
    p.add_argument(
        "groups",
        nargs="*",
        metavar="NAME=RANKS",
        help="a group and its ranks: 0, 0,2 or 1-3; replaces every group defined before",
    )
    p.add_argument("--clear", action="store_true", help="destroy every named group")


def parse_definitions(items: list[str]) -> dict[str, str]:
    """`["actor=0-3", "rollout=4-7"]` -> `{"actor": "0-3", "rollout": "4-7"}`."""
    named: dict[str, str] = {}
    for item in items:
        name, eq, spec = item.partition("=")
        if not eq or not name:
            msg = f"%nbtrain groups: {item!r} is not NAME=RANKS; write e.g. actor=0-3 rollout=4-7."
            raise ConfigError(msg)
        if name in named:
            msg = f"%nbtrain groups: group {name!r} is given twice."
            raise ConfigError(msg)
        named[name] = spec
    return named


def groups_table(specs: dict[str, list[int]], world_size: int) -> str:
    """The groups as a table: name, ranks, size, and which other groups share ranks with it."""
    from nbtrain.cluster.ranks.topology import compact, format_table

    if not specs:
        return "nbtrain: no groups are defined. Define them with %nbtrain groups actor=0-1 rollout=2-3."
    rows = [("group", "ranks", "size", "shares ranks with")]
    for name, ranks in specs.items():
        shared = [o for o, r in specs.items() if o != name and set(r) & set(ranks)]
        rows.append((name, compact(ranks), str(len(ranks)), ", ".join(shared) or "-"))
    head = f"nbtrain: {len(specs)} group(s) over {world_size} rank(s)"
    return f"{head}\n{format_table(rows)}"


def cmd_groups(args: argparse.Namespace) -> None:
    from nbtrain.cluster.facade import require_cluster

    cluster = require_cluster()
    if args.clear:
        if args.groups:
            raise ConfigError("%nbtrain groups: --clear takes no NAME=RANKS.")
        cluster.clear_groups()
        print("nbtrain: every named group was destroyed.")
        return
    specs = cluster.groups(**parse_definitions(args.groups))
    print(groups_table(specs, cluster.world_size))
