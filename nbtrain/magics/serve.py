"""`%nbtrain serve tinker` / `%nbtrain serve stop`: the Tinker-compatible service (issue 36).

Thin: parse, call `Cluster.serve_tinker()` (or `nbtrain.serve_tinker()` with no cluster), print the
base_url and the key to give the tinker SDK.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

log = logging.getLogger(__name__)


def add_serve_command(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="tinker: serve the Tinker protocol on the cluster's ranks (the tinker SDK and "
        "tinker-cookbook recipes train on them); stop: stop serving",
    )
    p.add_argument("what", choices=("tinker", "stop"), help="tinker: start serving; stop: stop")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1, this machine only)",
    )
    p.add_argument("--port", type=int, default=0, help="port (default: a free one)")
    p.add_argument(
        "--api-key",
        default=None,
        help="key every request must send (X-API-Key, TINKER_API_KEY), 'tml-...'; required "
        "with a --host beyond the loopback",
    )
    p.add_argument(
        "--root",
        default=None,
        help="folder of the models' runs and checkpoints (default $NBTRAIN_HOME/tinker)",
    )
    p.add_argument(
        "--session-timeout",
        type=float,
        default=600.0,
        help="seconds without a heartbeat or request after which a session ends, its models "
        "saved then unloaded (default 600; 0: never)",
    )


def cmd_serve(args: argparse.Namespace) -> Any:
    from nbtrain.cluster.facade import current_cluster
    from nbtrain.tinker.kernel import current_service, serve_tinker

    if args.what == "stop":
        service = current_service()
        if service is None:
            print("nbtrain: no Tinker service is running.")
            return None
        service.stop()
        print(f"nbtrain: the Tinker service at {service.url} stopped.")
        return None
    cluster = current_cluster()
    service = serve_tinker(
        cluster,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        root=args.root,
        session_timeout=args.session_timeout,
    )
    where = (
        f"{cluster.world_size} rank(s)"
        if cluster is not None
        else "this kernel (no cluster is running)"
    )
    print(f"nbtrain: serving the Tinker protocol on {where}, checkpoints under {service.root}")
    print(f"  base_url  {service.url}")
    print(
        f"  api key   {service.api_key}"
        + ("" if service.checked else "  (any tml- key is accepted on the loopback)")
    )
    print(
        f"  in this kernel: tinker.ServiceClient() (TINKER_BASE_URL and TINKER_API_KEY are set); "
        f"elsewhere: TINKER_BASE_URL={service.url} TINKER_API_KEY={service.api_key}"
    )
    return None


def print_models() -> None:
    """`%nbtrain status`'s lines for the Tinker service's live models, if one is serving."""
    import sys

    serving = sys.modules.get("nbtrain.tinker.kernel.serve")
    service = serving.current_service() if serving is not None else None
    if service is None:
        return
    import concurrent.futures

    try:
        rows = service.status(timeout=30)
    except concurrent.futures.TimeoutError:
        n = service.verbs.executor.pending()
        print(
            f"nbtrain: Tinker service at {service.url} is busy ({n} request(s) pending); try again."
        )
        return
    print(f"nbtrain: Tinker service at {service.url}, {len(rows)} live model(s)")
    for r in rows:
        mem = r.get("memory_bytes")
        mem_s = f"{mem / 2**20:.1f} MiB" if isinstance(mem, (int, float)) else "?"
        print(
            f"  {r.get('model_id')}  base {r.get('base_model')}  LoRA rank {r.get('lora_rank')}  "
            f"steps {r.get('steps')}  memory {mem_s}"
        )
