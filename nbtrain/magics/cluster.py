"""`%nbtrain` and `%%distributed`: thin magics over the Python API (`nbtrain.start`, `Cluster`)."""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
import time
from typing import Any

from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from nbtrain.errors import ConfigError, NbtrainError
from nbtrain.magics import check, faults, groups, scaling, serve
from nbtrain.magics.args import (
    HelpShown,
    Parser,
    add_launcher_args,
    add_multinode_commands,
    engine_count,
    launch_settings,
    positive_float,
    unknown_options,
)

log = logging.getLogger(__name__)


def build_parser() -> Parser:
    """The parser of `%nbtrain` and every subcommand (raises ConfigError instead of exiting)."""
    parser = Parser(prog="%nbtrain", description="Start, inspect and stop the nbtrain cluster.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)

    p = sub.add_parser("start", help="start engines and a process group; prints the rank table")
    p.add_argument(
        "-n",
        type=engine_count,
        default=None,
        help="engines (ranks) to start on this machine (default: one per GPU, or 1 without GPUs); "
        "with --launcher mpi or ray: the ranks there (mpiexec -n; Ray actors)",
    )
    p.add_argument(
        "--backend",
        choices=("auto", "gloo", "nccl"),
        default="auto",
        help="auto: NCCL on cuda:<local rank> when every rank has a GPU of its own, else gloo on "
        "CPU for every rank (with a line saying why); gloo: gloo, on the GPUs if every rank has "
        "its own; nccl: refused where a rank lacks a GPU",
    )
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=120.0,
        help="seconds to get every engine and the process group (default 120)",
    )
    p.add_argument("--force", action="store_true", help="stop a running cluster first")
    p.add_argument(
        "--allocator",
        choices=("auto", "tcmalloc", "system"),
        default=None,
        help="malloc of local engines. auto (default, or $NBTRAIN_ALLOCATOR): tcmalloc on a machine "
        "without GPUs where installed, 3-10%% faster CPU training here; system: glibc's",
    )
    add_launcher_args(p)

    sub.add_parser("stop", help="stop every engine and the controller")
    sub.add_parser("status", help="rank, host, local rank, device, pid, busy/idle")
    add_multinode_commands(sub)
    faults.add_fault_commands(sub)
    groups.add_group_commands(sub)
    check.add_check_command(sub)
    scaling.add_scaling_command(sub)
    serve.add_serve_command(sub)
    p = sub.add_parser(
        "log",
        help="show nbtrain's log from LEVEL up on stderr, here and on every rank (NBTRAIN_LOG)",
    )
    p.add_argument("level", choices=("debug", "info", "warning", "error"))
    return parser


_PARSERS: dict[tuple[Any, ...], Parser] = {}


def parser() -> Parser:
    """The `%nbtrain` parser, built on first use (it lists every launcher's options, which imports
    their modules) and again when the launcher registry changes."""
    from nbtrain.cluster.options import LAUNCHERS

    key = tuple(
        (name, mod, id(sys.modules.get(f"nbtrain.cluster.launch.{mod}")))
        for name, mod in LAUNCHERS.items()
    )
    if key not in _PARSERS:
        _PARSERS.clear()
        _PARSERS[key] = build_parser()
    return _PARSERS[key]


def _help_text() -> str:
    p = parser()
    parts = [p.format_help()]
    for name, sp in p._subparsers._group_actions[0].choices.items():  # type: ignore[union-attr]
        parts.append(f"--- %nbtrain {name} ---\n{sp.format_help()}")
    return "\n".join(parts)


@magics_class
class NbtrainMagics(Magics):
    """The magics `%load_ext nbtrain` registers."""

    @line_magic
    def nbtrain(self, line: str) -> Any:
        try:
            # a `# comment` after the options is the user's note, as in any Python line
            args = parser().parse_command(shlex.split(line, comments=True))
        except HelpShown:
            return None
        try:
            if args.command is None:
                print(_help_text())
                return None
            handler = getattr(self, f"_cmd_{args.command}")
            return handler(args)
        except NbtrainError as e:
            # a clear message, not a traceback into nbtrain's internals
            raise _user_error(e) from None

    def _cmd_start(self, args: argparse.Namespace) -> None:
        if args.launcher != "local":
            return self._cmd_start_remote(args)
        from nbtrain.cluster.api import start
        from nbtrain.cluster.launch import flags as launcher_flags
        from nbtrain.cluster.options import default_engine_count, local_gpu_count

        given = [k for k, v in launch_settings(args).items() if v not in (None, False)]
        if given:
            by_name = launcher_flags()
            flags = ", ".join(by_name[k][0].named for k in given)
            msg = (
                f"{flags}: multi-node settings, but no --launcher was given, so the engines would start "
                "on this machine only and they would be ignored. Add the launcher they are for, e.g. "
                "%nbtrain start --launcher ssh --hosts node1:2,node2:2 (or --launcher slurm, mpi, ray)."
            )
            raise ConfigError(msg)

        n = default_engine_count(args.n)
        t0 = time.monotonic()
        cluster = start(
            n=n,
            backend=args.backend,
            timeout=args.timeout,
            force=args.force,
            allocator=args.allocator,
            # said once the start goes ahead: a refused one (a cluster running) says only why
            announce=lambda k: print(
                f"nbtrain: starting {k} engine(s) on this machine...", flush=True
            ),
        )
        elapsed = time.monotonic() - t0
        print(
            f"nbtrain: process group ready: {cluster.world_size} rank(s), backend {cluster.backend}, "
            f"malloc {cluster.allocator}, in {elapsed:.1f} s"
        )
        if (
            cluster.allocator == "system"
            and cluster.options.allocator == "auto"
            and not local_gpu_count()
        ):
            from nbtrain.cluster.allocator import INSTALL_HINT

            print(f"nbtrain: tip: CPU training runs 3-10% faster with tcmalloc. {INSTALL_HINT}.")
        print(cluster.table())

    def _cmd_start_remote(self, args: argparse.Namespace) -> None:
        from nbtrain.cluster.api import start

        launch: dict[str, Any] = {"allow_version_mismatch": args.allow_version_mismatch}
        # only what was given: a setting of another launcher is an error, naming it
        launch.update({k: v for k, v in launch_settings(args).items() if v is not None})
        t0 = time.monotonic()
        cluster = start(
            n=args.n,
            launcher=args.launcher,
            backend=args.backend,
            timeout=args.timeout,
            force=args.force,
            quiet=False,
            allocator=args.allocator,
            **launch,
        )
        self._print_ready(cluster, time.monotonic() - t0)

    def _cmd_connect(self, args: argparse.Namespace) -> None:
        from nbtrain.cluster.api import connect

        t0 = time.monotonic()
        cluster = connect(
            args.cluster_id,
            profile=args.profile,
            file=args.file,
            iface=args.iface,
            port=args.port,
            backend=args.backend,
            timeout=args.timeout,
            allow_version_mismatch=args.allow_version_mismatch,
            force=args.force,
            quiet=False,
        )
        self._print_ready(cluster, time.monotonic() - t0)

    def _print_ready(self, cluster: Any, elapsed: float) -> None:
        print(
            f"nbtrain: process group ready: {cluster.world_size} rank(s) on {len(cluster.hosts)} "
            f"host(s), backend {cluster.backend}, in {elapsed:.1f} s"
        )
        print(cluster.table())

    def _cmd_probe(self, args: argparse.Namespace) -> None:
        from nbtrain.cluster.facade import require_cluster
        from nbtrain.cluster.probe import parse_size

        result = require_cluster().probe(max_bytes=parse_size(args.max_size), iters=args.iters)
        print(result)

    def _cmd_stop(self, args: argparse.Namespace) -> None:
        from nbtrain.cluster.facade import current_cluster

        cluster = current_cluster()
        if cluster is None:
            print("nbtrain: no cluster is running.")
            return
        cluster.stop()
        print("nbtrain: cluster stopped; no engine or controller is left running.")

    def _cmd_restart(self, args: argparse.Namespace) -> None:
        faults.cmd_restart(args)

    def _cmd_diagnose(self, args: argparse.Namespace) -> None:
        faults.cmd_diagnose(args)

    def _cmd_attach(self, args: argparse.Namespace) -> None:
        faults.cmd_attach(args)

    def _cmd_groups(self, args: argparse.Namespace) -> None:
        groups.cmd_groups(args)

    def _cmd_check(self, args: argparse.Namespace) -> None:
        check.cmd_check(args)

    def _cmd_scaling(self, args: argparse.Namespace) -> Any:
        return scaling.cmd_scaling(args, self.shell.user_ns if self.shell else {})

    def _cmd_serve(self, args: argparse.Namespace) -> Any:
        return serve.cmd_serve(args)

    def _cmd_log(self, args: argparse.Namespace) -> None:
        from nbtrain.cluster.facade import current_cluster
        from nbtrain.logs import set_log_level

        name = set_log_level(args.level)
        where = "this kernel"
        cluster = current_cluster()
        if cluster is not None and not cluster.stopped:
            cluster.run(set_log_level, name, timeout=30)
            where += f" and on {cluster.world_size} rank(s)"
        print(
            f"nbtrain: log level {name} in {where}; engines started later get NBTRAIN_LOG={name}."
        )

    def _cmd_status(self, args: argparse.Namespace) -> None:
        from nbtrain.cluster.facade import current_cluster
        from nbtrain.cluster.ranks.topology import format_table

        cluster = current_cluster()
        if cluster is None:
            print("nbtrain: no cluster is running. Start one with %nbtrain start -n 2.")
            serve.print_models()  # a Tinker service in this kernel
            return
        rows = cluster.status()
        header = ("rank", "host", "local", "device", "pid", "state")
        table = [header] + [
            (
                str(r["rank"]),
                r["host"],
                str(r["local_rank"]),
                r["device"],
                str(r["pid"]),
                r["state"],
            )
            for r in rows
        ]
        print(
            f"nbtrain: {cluster.world_size} rank(s), backend {cluster.backend}, cluster {cluster.cluster_id}"
        )
        print(format_table(table))
        serve.print_models()

    @magic_arguments()
    @argument("--ranks", default=None, help="run on these ranks only: 0, 0,2 or 1-3 (default: all)")
    @argument(
        "--group",
        default=None,
        metavar="NAME",
        help="run on this named group's ranks only (%%nbtrain groups); `group` is its process group",
    )
    @argument(
        "--timeout",
        type=float,
        default=None,
        help="fail the cell after S seconds and show where each rank was",
    )
    @argument(
        "--output",
        choices=("rank0", "all", "none"),
        default="rank0",
        help="whose output to show: rank 0 (default), every rank with a [rank N] prefix, or none",
    )
    @argument("--no-live", action="store_true", help="do not draw live plots from nbtrain.log()")
    @cell_magic
    def distributed(self, line: str, cell: str) -> None:
        """Run this cell on every rank of the nbtrain cluster, in each rank's persistent namespace.

        The names rank, local_rank, world_size and device are defined, and the torchrun environment
        (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...) is set, so torch.distributed code runs as is:

            %%distributed
            import torch, torch.distributed as dist
            t = torch.tensor([float(rank)]); dist.all_reduce(t)
            print(t)        # rank 0's output is shown; --output all shows every rank's

        With --group NAME the cell runs on the ranks of a group made by %nbtrain groups, and `group`
        is that group's process group (the world group in a cell without --group).

        A failure on any rank fails the cell, naming the rank(s), host and remote traceback.
        Interrupting the kernel interrupts every rank.
        """
        from nbtrain.cluster.facade import require_cluster

        args = _distributed_args(line)
        if args is None:
            return
        try:
            cluster = require_cluster()
            cluster.execute(
                cell,
                ranks=args.ranks,
                group=args.group,
                output=args.output,
                timeout=args.timeout,
                live=not args.no_live,
            )
        except NbtrainError as e:
            raise _user_error(e) from None


NbtrainMagics.nbtrain.__doc__ = f"""Start, inspect and stop the nbtrain cluster.

    %nbtrain start -n 2          # local engines; prints the rank table when the group is ready
    %nbtrain start --launcher ssh --hosts node1:2,node2:2   # engines on other hosts over SSH
    %nbtrain start --launcher slurm --nodes 2 --gpus-per-node 4 --partition gpu --time 02:00:00
    %nbtrain start --launcher mpi -n 8                      # engines started by mpiexec
    %nbtrain start --launcher ray --address auto -n 8 --gpus-per-rank 1 --placement SPREAD
    %nbtrain connect --profile P # attach to an ipyparallel cluster started any way
    %nbtrain probe               # all-reduce bandwidth and latency across the ranks
    %nbtrain groups actor=0-1 rollout=2-3   # named sub-groups; %%distributed --group actor
    %nbtrain check               # each node's CPUs, GPUs and versions; --hosts n1,n2 before a start
    %nbtrain status              # rank, host, local rank, device, pid, busy/idle
    %nbtrain stop

{_help_text()}"""


def _distributed_args(line: str) -> argparse.Namespace | None:
    """`%%distributed`'s options from `line`; None after printing its help for -h or --help."""
    parser = NbtrainMagics.distributed.parser  # type: ignore[attr-defined]
    tokens = shlex.split(line, comments=True)

    # magic_arguments writes its usage as reST ("::" and an indented %distributed); a user types %%
    def plain(text: str) -> str:
        return text.replace("::\n\n  %distributed", "usage: %%distributed", 1)

    usage = plain(parser.format_usage()).strip()
    if "-h" in tokens or "--help" in tokens:
        print(plain(parser.format_help()))
        return None
    try:
        args, extra = parser.parse_known_args(tokens)
    except Exception as e:  # a bad value: magic_arguments raises UsageError
        msg = f"%%distributed: {e}\n\n{usage}\nSee %%distributed --help."
        raise ConfigError(msg) from None
    if extra:
        msg = (
            f"%%distributed: {unknown_options(parser, extra)}\n\n{usage}\nSee %%distributed --help."
        )
        raise ConfigError(msg)
    return args


def _user_error(e: NbtrainError) -> NbtrainError:
    # keep the type (tests and callers catch it) but drop the chained internals from the display
    e.__cause__ = None
    e.__context__ = None
    return e
