"""The argument types and option groups the `%nbtrain` subcommands share (argparse, no kernel)."""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from nbtrain.errors import ConfigError

_CHOICE = re.compile(r"invalid choice: '(?P<word>[^']*)' \(choose from (?P<choices>.*)\)")


def nearest(word: str, known: Iterable[str]) -> str | None:
    """The known name closest to a mistyped `word` (`--backnd` -> `--backend`), if one is close."""
    found = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return found[0] if found else None


def unknown_options(parser: argparse.ArgumentParser, extra: Sequence[str]) -> str:
    """ "unrecognized arguments: --backnd gloo; did you mean --backend?" for `parser`'s options."""
    options = [o for o in parser._option_string_actions if o.startswith("--")]
    guesses = []
    for token in extra:
        if token.startswith("-"):
            guess = nearest(token.split("=", 1)[0], options)
            if guess and guess not in guesses:
                guesses.append(guess)
    hint = f"; did you mean {' or '.join(guesses)}?" if guesses else ""
    return f"unrecognized arguments: {' '.join(extra)}{hint}"


class Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting the kernel, naming the nearest option or choice."""

    def error(self, message: str) -> None:  # type: ignore[override]
        m = _CHOICE.search(message)
        if m:
            guess = nearest(m["word"], re.findall(r"[\w.-]+", m["choices"]))
            message += f"; did you mean {guess}?" if guess else ""
        msg = f"{self.prog}: {message}\n\n{self.format_usage().strip()}\nSee {self.prog} --help."
        raise ConfigError(msg)

    def parse_command(self, tokens: Sequence[str]) -> argparse.Namespace:
        """`parse_args`, but an unknown option is reported by its subcommand's parser, with that
        subcommand's usage and the nearest option it has."""
        args, extra = self.parse_known_args(tokens)
        if extra:
            sub = self._subcommand(getattr(args, "command", None)) or self
            sub.error(unknown_options(sub, extra))
        return args

    def _subcommand(self, name: str | None) -> argparse.ArgumentParser | None:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and name:
                return action.choices.get(name)
        return None

    def exit(self, status: int = 0, message: str | None = None) -> None:  # type: ignore[override]
        if message:
            print(message, file=sys.stderr)
        raise HelpShown()


class HelpShown(Exception):
    """`--help` was printed: the magic returns without running anything."""


def positive_float(text: str) -> float:
    """An argparse type: a positive number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number of seconds")
    return value


def engine_count(text: str) -> int:
    """An argparse type: a whole number of engines, at least 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number of engines (e.g. -n 2)"
        ) from None
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of engines (e.g. -n 2)")
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: start at least one engine (e.g. -n 2)")
    return int(value)


def add_multinode_start_args(p: argparse.ArgumentParser) -> None:
    """The --launcher ssh/slurm/mpi options of `%nbtrain start`."""
    g = p.add_argument_group("multi-node (--launcher ssh, slurm, mpi or ray)")
    g.add_argument(
        "--launcher",
        choices=("local", "ssh", "slurm", "mpi", "ray"),
        default="local",
        help="local: engines on this machine; ssh: on --hosts; slurm: as one sbatch job; "
        "mpi: with mpiexec -n N; ray: as actors in a Ray placement group",
    )
    g.add_argument(
        "--hosts",
        default=None,
        help="ssh, mpi: HOST[:ENGINES],... e.g. node1:2,node2:2 (ssh default engines: the host's "
        "GPU count, 1 on CPU; mpi: 1)",
    )
    g.add_argument(
        "--ip",
        default=None,
        help="controller listen address (default: the one routing to the hosts or Slurm nodes)",
    )
    g.add_argument(
        "--iface",
        default=None,
        help="network interface for NCCL/gloo on every node (default: the one reaching rank 0)",
    )
    g.add_argument(
        "--port", type=int, default=None, help="rendezvous port on rank 0's host (default: free)"
    )
    g.add_argument(
        "--allow-version-mismatch",
        action="store_true",
        help="start although torch, NCCL or nbtrain versions differ across nodes",
    )
    g.add_argument(
        "--python",
        default=None,
        help="Python with nbtrain on every host (default: this kernel's interpreter path)",
    )
    g.add_argument(
        "--ssh-args", default=None, help='ssh: extra ssh arguments, e.g. "-F ~/.ssh/cluster"'
    )
    # their values are checked where they enter the Python API (nbtrain.cluster.options.validate_slurm),
    # so the magic and nbtrain.start(launcher="slurm", ...) say the same thing
    s = p.add_argument_group("slurm (--launcher slurm)")
    s.add_argument(
        "--nodes", default=None, help="nodes to allocate (default 1); ray: nodes to spread over"
    )
    s.add_argument(
        "--gpus-per-node",
        default=None,
        help="GPUs per node (sbatch --gpus-per-node); one engine per GPU",
    )
    s.add_argument(
        "--engines-per-node",
        default=None,
        help="engines per node (default: --gpus-per-node, or 1 on CPU nodes; ray: 1)",
    )
    s.add_argument("--partition", default=None, help="partition (default: the cluster's default)")
    s.add_argument("--account", default=None, help="account to charge the job to")
    s.add_argument("--time", default=None, help="time limit: 90 (minutes), 02:00:00, 1-12:00:00")
    s.add_argument(
        "--slurm-args",
        default=None,
        help='more sbatch options, e.g. "--qos=high --constraint=a100"',
    )
    m = p.add_argument_group("mpi (--launcher mpi)")
    m.add_argument(
        "--mpi-args", default=None, help='more mpiexec arguments, e.g. "--oversubscribe"'
    )
    r = p.add_argument_group("ray (--launcher ray; also -n, or --nodes and --engines-per-node)")
    r.add_argument(
        "--address",
        default=None,
        help="auto: the Ray cluster this machine is in (default); local: a private one here; "
        "ray://HEAD:10001: a remote head",
    )
    r.add_argument(
        "--placement",
        default=None,
        help="PACK (default), SPREAD, STRICT_PACK or STRICT_SPREAD: how Ray places the ranks",
    )
    r.add_argument("--gpus-per-rank", default=None, help="GPUs for each rank (default 0)")
    r.add_argument("--cpus-per-rank", default=None, help="CPUs for each rank (default 1)")


def add_multinode_commands(sub: Any) -> None:
    """`%nbtrain connect` and `%nbtrain probe`."""
    c = sub.add_parser("connect", help="attach to an ipyparallel cluster started any way")
    c.add_argument("cluster_id", nargs="?", default=None, help="the ipyparallel cluster id")
    c.add_argument("--profile", default=None, help="IPython profile of the cluster")
    c.add_argument("--file", default=None, help="the cluster's JSON file (security/cluster-*.json)")
    c.add_argument("--iface", default=None, help="network interface for NCCL/gloo on every node")
    c.add_argument("--port", type=int, default=None, help="rendezvous port on rank 0's host")
    c.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    c.add_argument("--timeout", type=positive_float, default=120.0)
    c.add_argument("--allow-version-mismatch", action="store_true")
    c.add_argument("--force", action="store_true", help="stop a running cluster first")
    pr = sub.add_parser("probe", help="all-reduce bandwidth and latency across the ranks")
    pr.add_argument(
        "--max-size", default="64M", help="largest all-reduce message, e.g. 64M (default)"
    )
    pr.add_argument("--iters", type=int, default=5, help="timed repetitions per size")
