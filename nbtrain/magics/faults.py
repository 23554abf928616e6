"""The fault subcommands of `%nbtrain`: restart, diagnose, attach. Thin: parse, call the API, print."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from nbtrain.magics.args import positive_float

log = logging.getLogger(__name__)


def add_fault_commands(sub: Any) -> None:
    """`%nbtrain restart`, `diagnose` and `attach`."""
    p = sub.add_parser(
        "restart",
        help="replace dead or wedged engines and re-create the process group (their variables are lost)",
    )
    p.add_argument(
        "--all", action="store_true", help="replace every engine, not only dead or wedged ones"
    )
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=None,
        help="seconds to get the new engines and group",
    )
    p = sub.add_parser(
        "diagnose",
        help="every rank's Python stacks and who waits in a collective; works while a cell runs",
    )
    p.add_argument("--ranks", default=None, help="only these ranks: 0, 0,2 or 1-3 (default: all)")
    p.add_argument(
        "--timeout", type=positive_float, default=8.0, help="seconds to wait for the ranks' answers"
    )
    p = sub.add_parser(
        "attach",
        help="reconnect this kernel to a running cluster (after a kernel restart) and its running job",
    )
    p.add_argument(
        "cluster_id", nargs="?", default=None, help="which cluster (default: the only one)"
    )
    p.add_argument(
        "--profile", default=None, help="IPython profile the cluster lives in (default: nbtrain)"
    )
    p.add_argument("--no-live", action="store_true", help="do not follow the running job's metrics")


def cmd_restart(args: argparse.Namespace) -> None:
    from nbtrain.cluster.facade import require_cluster

    cluster = require_cluster()
    print("nbtrain: restarting dead or wedged ranks...", flush=True)
    print(cluster.restart(all_ranks=args.all, timeout=args.timeout))
    print(cluster.table())


def cmd_diagnose(args: argparse.Namespace) -> None:
    from nbtrain.cluster.facade import require_cluster

    cluster = require_cluster()
    diag = cluster.diagnose(ranks=args.ranks, timeout=args.timeout)
    print(diag.text)


def cmd_attach(args: argparse.Namespace) -> None:
    from nbtrain.cluster.api import attach

    kwargs: dict[str, Any] = {"live": not args.no_live}
    if args.profile:
        kwargs["profile"] = args.profile
    attach(args.cluster_id, **kwargs)
