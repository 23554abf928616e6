"""The argument types and option groups the `%nbtrain` subcommands share (argparse, no kernel)."""

from __future__ import annotations

import argparse
import difflib
import logging
import re
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from nbtrain.errors import ConfigError

log = logging.getLogger(__name__)

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


def add_launcher_args(p: argparse.ArgumentParser) -> None:
    """`--launcher` and every launcher's options, made from what each launcher declares
    (`nbtrain.cluster.launch.declared`): the options several launchers share in one help group, then a
    group per launcher for its own. Each flag's dest is the option's Python name; values stay text
    here and are checked where they enter the Python API (`LaunchOptions`), so the magic and
    `nbtrain.start(launcher=...)` say the same thing."""
    from nbtrain.cluster import launch
    from nbtrain.cluster.options import startable

    declared = launch.declared()
    remote = [name for name in startable() if declared[name] and name != "local"]
    summary = "; ".join(
        f"{name}: {getattr(launch.launcher_module(name), 'SUMMARY', name)}" for name in startable()
    )
    listed = ", ".join(remote[:-1]) + f" or {remote[-1]}" if len(remote) > 1 else "".join(remote)
    shared = p.add_argument_group(f"multi-node (--launcher {listed})")
    shared.add_argument("--launcher", choices=startable(), default="local", help=summary)
    groups: dict[str, Any] = {}
    for name, (opt, takers) in launch.flags().items():
        cli = opt.cli
        if cli is None or cli in p._option_string_actions:
            continue  # Python only, or a flag the command has already (-n)
        # one declaration that several launchers list (base.NETWORK) is the shared group's
        same = all(o is opt for x in takers for o in declared[x] if o.name == name)
        if len(takers) > 1 and same:
            group = shared
        else:
            first = takers[0]
            if first not in groups:
                groups[first] = p.add_argument_group(f"{first} (--launcher {first})")
            group = groups[first]
        helps = [(x, o.help) for x in takers for o in declared[x] if o.name == name]
        if len({h for _, h in helps}) > 1:
            help_text = "; ".join(f"{x}: {h}" for x, h in helps)
        else:
            help_text = helps[0][1]
        help_text = help_text.replace("%", "%%")
        if opt.kind == "switch":
            group.add_argument(cli, dest=name, action="store_true", default=None, help=help_text)
        else:
            metavar = opt.metavar or name.upper()
            if opt.kind == "choice" and not opt.metavar:
                metavar = "{" + ",".join(opt.choices) + "}"
            group.add_argument(cli, dest=name, default=None, metavar=metavar, help=help_text)


def launch_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The launchers' options as `%nbtrain start` got them (None where not given), by their Python
    names; -n is the command's own."""
    from nbtrain.cluster import launch

    return {
        name: getattr(args, name) for name in launch.flags() if name != "n" and hasattr(args, name)
    }


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
