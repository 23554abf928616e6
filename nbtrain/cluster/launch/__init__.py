"""Launchers: one module each, the same contract, looked up in the registry (`options.LAUNCHERS`).

Each launcher module has `start(options, launch_options, quiet) -> Launched`: it starts (or finds)
the engines, gives them ranks and a process group, and returns them with a stop function (and a
replace function where it can replace single engines). `Cluster` wraps what comes back.

    local.py    engines on this machine           ssh.py      engines on --hosts over SSH
    slurm.py    one sbatch job                    mpi.py      one mpiexec
    ray.py      Ray actors in a placement group   connect.py  an ipyparallel cluster started elsewhere

Shared by the multi-node ones: `base.py` (the `EngineLaunch` contract, the start, hello, stop, and
the options every multi-node launcher takes: `NETWORK`, `PYTHON`), `network.py` (interfaces,
MASTER_ADDR, port) and `preflight.py` (versions across ranks).

A launcher's settings are declared once, in its module, as `options.Option`s:

    OPTIONS = (*base.NETWORK, Option("partition", "partition (default: the cluster's default)",
                                     label="Partition"), ...)
    HINT = "give --nodes and --gpus-per-node"      # said when another launcher's setting is given
    def validate(lo): ...                           # what depends on several settings at once

From those come `LaunchOptions`' checks (below), the `%nbtrain start` flags and their help groups
(`nbtrain.magics.args`), the picker's fields (`nbtrain.display.picker.shared.OptionFields`) and the
options table in docs/magics.md (`python -m nbtrain.cluster.launch.options_doc`).

Adding a launcher: write `launch/NAME.py` with a `start` as above (usually an `EngineLaunch`
subclass passed to `base.start_engines`) and its `OPTIONS`, and add `"NAME": "NAME"` to
`options.LAUNCHERS`. Adding an option to a launcher: one `Option` in its `OPTIONS` (and its test).
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType
from typing import Any

from nbtrain.cluster.options import (
    LAUNCHERS,
    Option,
    StartOptions,
    check_launch,
    not_given,
    startable,
)
from nbtrain.cluster.session import Launched
from nbtrain.errors import ConfigError

log = logging.getLogger(__name__)


def launcher_module(name: str) -> ModuleType:
    """The module of launcher `name`, from the registry; a ConfigError names the known ones."""
    if name not in LAUNCHERS:
        msg = f"unknown launcher {name!r}; choose one of {', '.join(LAUNCHERS)}."
        raise ConfigError(msg)
    return importlib.import_module(f"nbtrain.cluster.launch.{LAUNCHERS[name]}")


def declared() -> dict[str, tuple[Option, ...]]:
    """Launcher name -> the options its module declares (`OPTIONS`), in the registry's order.

    Imports every launcher's module (a plug-in registry: loaded by name, not imported here)."""
    return {name: tuple(getattr(launcher_module(name), "OPTIONS", ())) for name in startable()}


def flags() -> dict[str, tuple[Option, list[str]]]:
    """Option name -> (its first declaration, the launchers that take it), over every launcher."""
    out: dict[str, tuple[Option, list[str]]] = {}
    for launcher, opts in declared().items():
        for o in opts:
            first, takers = out.setdefault(o.name, (o, []))
            if o.kind != first.kind or o.cli != first.cli:
                msg = (
                    f"launchers {takers[0]} and {launcher} both declare {o.name!r} but as "
                    f"{first.kind} {first.cli} and {o.kind} {o.cli}; one name, one flag and kind"
                )
                raise ValueError(msg)
            takers.append(launcher)
    return out


class LaunchOptions:
    """Settings of a multi-node start (`%nbtrain start --launcher ssh|slurm|mpi|ray ...`), checked on
    entry against the options the launcher declares: each is an attribute (another launcher's read
    as left out: None, [], {} or False).

    In [1]: LaunchOptions(launcher="slurm", nodes=2, gpus_per_node=4).nodes
    Out[1]: 2
    """

    launcher: str

    def __init__(self, launcher: str = "ssh", **given: Any) -> None:
        if launcher == "local":
            msg = (
                "hosts, ip, iface, port and the other multi-node settings need launcher='ssh', "
                "'slurm', 'mpi' or 'ray' (%nbtrain start --launcher ssh --hosts ...)."
            )
            raise ConfigError(msg)
        if launcher not in startable():
            choices = ", ".join(startable())
            msg = f"unknown launcher {launcher!r}; choose one of {choices}."
            raise ConfigError(msg)
        module = launcher_module(launcher)
        values = check_launch(launcher, given, declared(), getattr(module, "HINT", ""))
        self.__dict__.update(values, launcher=launcher)
        validate = getattr(module, "validate", None)
        if validate is not None:
            validate(self)

    def __getattr__(self, name: str) -> Any:
        # only reached for a name no launcher declares (declared ones are set in __init__)
        msg = f"no launcher declares a setting {name!r}"
        raise AttributeError(msg)

    def __setattr__(self, name: str, value: Any) -> None:
        # a launcher's validate() settles declared settings (the rank count); a typo is an error
        if name != "launcher" and name not in vars(self):
            msg = f"no launcher declares a setting {name!r}"
            raise AttributeError(msg)
        super().__setattr__(name, value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LaunchOptions) and vars(self) == vars(other)

    def __repr__(self) -> str:
        given = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not not_given(v))
        return f"LaunchOptions({given})"


def parse_launch(launcher: str, kwargs: dict[str, Any]) -> LaunchOptions:
    """LaunchOptions from `nbtrain.start(launcher=..., **kwargs)`; unknown settings are an error."""
    return LaunchOptions(launcher=launcher, **kwargs)


def start(options: StartOptions, lo: LaunchOptions | None, quiet: bool = True) -> Launched:
    """Start engines with the launcher `lo` names (this machine's without `lo`)."""
    name = "local" if lo is None else lo.launcher
    launched: Launched = launcher_module(name).start(options, lo, quiet=quiet)
    return launched
