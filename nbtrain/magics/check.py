"""`%nbtrain check`: every node's host, CPUs, GPUs and versions, the odd ones marked, with fixes;
`%nbtrain check --model PATH`: what each path does with that model.

Thin: parse, call `Cluster.check()` or `nbtrain.check(...)`, print.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from nbtrain.magics.args import positive_float

log = logging.getLogger(__name__)


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
    # the sources' settings: flags made from the options their launchers declare
    from nbtrain.cluster.check import check_settings
    from nbtrain.cluster.launch import flags

    declared = flags()
    for name in dict.fromkeys(n for names in check_settings().values() for n in names):
        opt, takers = declared[name]
        if opt.cli is None:
            continue
        who = [x for x, names in check_settings().items() if name in names]
        text = f"{', '.join(who)}: {opt.help}".replace("%", "%%")
        p.add_argument(
            opt.cli, dest=name, default=None, metavar=opt.metavar or name.upper(), help=text
        )
    p.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help="instead of the nodes: what each path does with this model (a folder or Hub id), from "
        "its config alone: LoRA targets and their parameters, experts, packing, FSDP2, QLoRA, vLLM",
    )
    p.add_argument(
        "--lora-r", type=int, default=16, dest="lora_r", help="with --model: the LoRA rank to count"
    )
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=None,
        help="seconds to wait for every node (default: 30 on a cluster, 60 over SSH, 120 Slurm)",
    )


def cmd_check(args: argparse.Namespace) -> Any:
    """Run the check the options name and print its table and advice; returns the result."""
    from nbtrain.cluster.check import check, check_settings
    from nbtrain.cluster.facade import current_cluster

    if args.model:
        from nbtrain.model.report import check_model

        report = check_model(args.model, lora_r=args.lora_r)
        print(report)
        return None
    names = {n for names in check_settings().values() for n in names}
    given = {k: v for k in names if (v := getattr(args, k, None)) is not None}
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
