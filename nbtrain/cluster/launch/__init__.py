"""Launchers: one module each, the same contract, looked up in the registry (`options.LAUNCHERS`).

Each launcher module has `start(options, launch_options, quiet) -> Launched`: it starts (or finds)
the engines, gives them ranks and a process group, and returns them with a stop function (and a
replace function where it can replace single engines). `Cluster` wraps what comes back.

    local.py    engines on this machine           ssh.py      engines on --hosts over SSH
    slurm.py    one sbatch job                    mpi.py      one mpiexec
    connect.py  an ipyparallel cluster started elsewhere

Shared by the multi-node ones: `base.py` (the `EngineLaunch` contract, the start, hello, stop),
`network.py` (interfaces, MASTER_ADDR, port) and `preflight.py` (versions across ranks).

Adding a launcher (Ray is next): write `launch/ray.py` with a `start` as above (usually an
`EngineLaunch` subclass passed to `base.start_engines`), and add `"ray": "ray"` to `LAUNCHERS`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from nbtrain.cluster.options import LAUNCHERS, LaunchOptions, StartOptions
from nbtrain.cluster.session import Launched
from nbtrain.errors import ConfigError


def launcher_module(name: str) -> ModuleType:
    """The module of launcher `name`, from the registry; a ConfigError names the known ones."""
    if name not in LAUNCHERS:
        msg = f"unknown launcher {name!r}; choose one of {', '.join(LAUNCHERS)}."
        raise ConfigError(msg)
    return importlib.import_module(f"nbtrain.cluster.launch.{LAUNCHERS[name]}")


def start(options: StartOptions, lo: LaunchOptions | None, quiet: bool = True) -> Launched:
    """Start engines with the launcher `lo` names (this machine's without `lo`)."""
    name = "local" if lo is None else lo.launcher
    launched: Launched = launcher_module(name).start(options, lo, quiet=quiet)
    return launched
