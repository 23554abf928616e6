"""`%nbtrain check`: every node's host, CPUs, GPUs and versions, the odd ones marked, with fixes.

Thin: parse, call `Cluster.check()` or `nbtrain.check(...)`, print.
"""

from __future__ import annotations

import argparse
from typing import Any

from nbtrain.magics.args import positive_float


def add_check_command(sub: Any) -> None:
    """`%nbtrain check`: the running cluster's nodes, or (with a source) nodes before a start."""
    p = sub.add_parser(
        "check",
        help="each node's host, CPUs, GPUs, Python, torch, CUDA, NCCL, nbtrain; odd ones marked",
    )
    p.add_argument(
        "--launcher",
        choices=("local", "ssh", "slurm", "ray"),
        default=None,
        help="check before a start: local (this machine), ssh (--hosts), slurm (--partition, "
        "--nodes), ray (--address); default: the running cluster, else what the options name, "
        "else local",
    )
    p.add_argument("--hosts", default=None, help="ssh: HOST,... e.g. node1,node2")
    p.add_argument("--ssh-args", default=None, help='ssh: extra ssh arguments, e.g. "-F cfg"')
    p.add_argument(
        "--python",
        default=None,
        help="Python with nbtrain on every node (default: this one's path)",
    )
    p.add_argument("--partition", default=None, help="slurm: partition to run the probe in")
    p.add_argument("--nodes", default=None, help="slurm: nodes to check (default 1)")
    p.add_argument("--account", default=None, help="slurm: account to charge")
    p.add_argument("--time", default=None, help="slurm: time limit of the probe's job")
    p.add_argument("--slurm-args", default=None, help='slurm: more srun options, e.g. "--qos=high"')
    p.add_argument(
        "--address", default=None, help="ray: auto, local or ray://HEAD:10001 (every alive node)"
    )
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=None,
        help="seconds to wait for every node (default: 30 on a cluster, 60 over SSH, 120 Slurm)",
    )


def cmd_check(args: argparse.Namespace) -> Any:
    """Run the check the options name and print its table and advice; returns the result."""
    from nbtrain.cluster.check import check
    from nbtrain.cluster.facade import current_cluster

    settings: dict[str, Any] = {
        "hosts": args.hosts,
        "ssh_args": args.ssh_args,
        "remote_python": args.python,
        "partition": args.partition,
        "nodes": args.nodes,
        "account": args.account,
        "time": args.time,
        "slurm_args": args.slurm_args,
        "address": args.address,
    }
    given = {k: v for k, v in settings.items() if v is not None}
    cluster = current_cluster()
    if args.launcher is None and not given and cluster is not None:
        result = cluster.check(**({"timeout": args.timeout} if args.timeout else {}))
        print(f"nbtrain: {len(cluster.hosts)} host(s) of the running cluster:")
    else:
        if args.launcher is None and not given:
            print("nbtrain: no cluster is running; checking this machine (--launcher local).")
        result = check(launcher=args.launcher, timeout=args.timeout, **given)
    print(result)
    return None
