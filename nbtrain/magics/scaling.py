"""`%nbtrain scaling`: the running cluster's scaling from 1 to N nodes, a model's prediction past
them, and what limits it. Thin: parse, call `Cluster.scaling`, display."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from nbtrain.errors import ConfigError
from nbtrain.magics.args import positive_float

log = logging.getLogger(__name__)


def add_scaling_command(sub: Any) -> None:
    """`%nbtrain scaling --config cfg --nodes 1,2,4 [--steps N] [--mode weak|strong] ...`."""
    p = sub.add_parser(
        "scaling",
        help="the same short finetune on the first 1, 2, 4... nodes: tokens/s, efficiency, "
        "all-reduce wait, a model's prediction past them and what limits scaling",
    )
    p.add_argument("--config", required=True, help="name of an nbtrain.SFTConfig in the notebook")
    p.add_argument("--nodes", default=None, help="sizes to measure, in nodes: 1,2,4")
    p.add_argument(
        "--ranks", default=None, help="sizes in ranks instead of nodes (one machine): 1,2,4"
    )
    p.add_argument("--steps", type=int, default=30, help="steps per size (default 30; 2 warm up)")
    p.add_argument(
        "--mode",
        choices=("weak", "strong"),
        default="weak",
        help="weak (default): the same per-device batch at every size; strong: the same global batch",
    )
    p.add_argument("--predict", default=None, help="sizes to predict with the model: 8,16,64")
    p.add_argument(
        "--busbw",
        type=positive_float,
        default=None,
        help="bus bandwidth in GB/s to assume for --predict (default: the largest measured size's)",
    )
    p.add_argument(
        "--latency",
        type=positive_float,
        default=None,
        help="all-reduce latency in microseconds to assume for --predict (default: as measured)",
    )
    p.add_argument(
        "--threshold",
        type=positive_float,
        default=0.9,
        help="the efficiency the verdict calls near-linear (default 0.9)",
    )
    p.add_argument("--out", default=None, help="folder for scaling.md, scaling.png, scaling.json")
    p.add_argument(
        "--timeout", type=positive_float, default=None, help="seconds each size may take"
    )


def cmd_scaling(args: argparse.Namespace, user_ns: dict[str, Any]) -> Any:
    """Run the scaling measurement and show its report; returns the `ScalingReport`."""
    from nbtrain.cluster.facade import require_cluster

    if args.config not in user_ns:
        msg = f"--config {args.config}: no such name in the notebook; make it with cfg = nbtrain.SFTConfig(...)"
        raise ConfigError(msg)
    cluster = require_cluster()
    report = cluster.scaling(
        user_ns[args.config],
        nodes=args.nodes,
        ranks=args.ranks,
        steps=args.steps,
        mode=args.mode,
        predict=args.predict or (),
        out=args.out,
        busbw=args.busbw * 1e9 if args.busbw else None,
        latency=args.latency * 1e-6 if args.latency else None,
        threshold=args.threshold,
        timeout=args.timeout,
    )
    from IPython.display import Image, Markdown, display

    display(Markdown(report.markdown()))
    display(Image(data=report.png(), format="png"))
    if report.folder:
        print(f"nbtrain: report written to {report.folder} (scaling.md, scaling.png, scaling.json)")
    return report
