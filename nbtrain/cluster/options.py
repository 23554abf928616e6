"""The settings of a start, checked where they enter: `StartOptions`, the launcher registry, and
`Option`, how a launcher declares a setting of its own, with the checks made from it.

A primitive: plain dataclasses and their checks, nothing started. Every check runs before any engine
does; a wrong value is a `ConfigError` naming the flag and a value that works.

The launcher registry is `LAUNCHERS` below: one line per launcher, name -> its module under
`nbtrain.cluster.launch` (imported only when a start uses it, or when the options are listed). A new
launcher is one new module there and one line here. Its settings are `Option`s in its module
(`OPTIONS`); `nbtrain.cluster.launch.LaunchOptions` checks a start's settings against them with
`check_launch` below, and the magic's flags, the picker's fields and the docs table are made from them.
"""

from __future__ import annotations

import copy
import ipaddress
import logging
import os
import re
import shlex
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nbtrain import net
from nbtrain.cluster import allocator
from nbtrain.engine import setup
from nbtrain.errors import ConfigError

log = logging.getLogger(__name__)

BACKENDS = ("auto", "gloo", "nccl")
PROFILE = "nbtrain"
# The hub only admits a new engine after a heartbeat round; ipyparallel's 3 s default makes a cold
# start wait ~5 s for nothing. 500 ms also lets the hub notice a dead engine within ~5 s.
HEARTBEAT_MS = 500

# the registry: launcher name -> module of nbtrain.cluster.launch that starts its engines
LAUNCHERS = {
    "local": "local",
    "ssh": "ssh",
    "slurm": "slurm",
    "mpi": "mpi",
    "ray": "ray",  # engines as Ray actors in one placement group
    "connect": "connect",  # an ipyparallel cluster started elsewhere (nbtrain.connect)
}


def startable() -> tuple[str, ...]:
    """What --launcher takes: every registered launcher but connect (an existing cluster)."""
    return tuple(name for name in LAUNCHERS if name != "connect")


LAUNCH_HOST_ENV = "NBTRAIN_LAUNCH_HOST"
MPIEXEC = "mpiexec"

# the idle watchdog's limit (nbtrain.cluster.faults.watchdog)
DEFAULT_IDLE = 1800.0
IDLE_ENV = "NBTRAIN_IDLE_TIMEOUT"


@dataclass
class StartOptions:
    """Settings of `nbtrain.start` / `%nbtrain start`, validated before anything starts."""

    n: int = 1  # how many engines (ranks) to start on this machine
    backend: str = "auto"  # auto (NCCL where every rank has its own GPU, else gloo), gloo or nccl
    timeout: float = 120.0  # seconds to get every engine and the process group, else fail
    pg_timeout: float = 1800.0  # seconds a collective may wait before torch gives up
    force: bool = False  # stop a running cluster first instead of refusing
    profile: str = PROFILE  # IPython profile holding the cluster's connection files
    extra_env: dict[str, str] = field(default_factory=dict)  # more environment for every rank
    allocator: str | None = None  # local engines' malloc: auto, tcmalloc or system (allocator.py)

    def __post_init__(self) -> None:
        n = self.n
        if isinstance(n, bool) or not isinstance(n, int):
            try:
                as_float = float(n)
            except (TypeError, ValueError):
                as_float = float("nan")
            if as_float != as_float or as_float != int(as_float):
                msg = f"-n {n!r} is not a whole number of engines; use e.g. -n 2."
                raise ConfigError(msg)
            n = int(as_float)
        if n < 1:
            msg = f"-n {n} asks for no engines; start at least one, e.g. -n 2."
            raise ConfigError(msg)
        self.n = n
        if self.backend not in BACKENDS:
            msg = f"unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}."
            raise ConfigError(msg)
        if self.timeout <= 0:
            msg = f"--timeout {self.timeout} must be a positive number of seconds."
            raise ConfigError(msg)
        self.allocator = allocator.resolve(self.allocator)


def local_gpu_count() -> int:
    """GPUs this machine exposes, without importing torch or creating a CUDA context."""
    return setup.cuda_count()


def default_engine_count(n: int | None = None) -> int:
    """`n`, or one engine per GPU of this machine (at least one), as torchrun's --nproc-per-node gpu.

    The one default of `nbtrain.start()` and `%nbtrain start`.
    """
    return max(1, local_gpu_count()) if n is None else n


# -- a launcher's options: declared once, in the launcher's module --------------------------------

#: what an option's value is, and so how it is checked, typed on the command line and shown in the
#: picker: text; count (a whole number >= 1); count0 (>= 0); amount (a number >= 0); choice (one of
#: `choices`, any case, - for _); args (extra command-line arguments: a string is split as a shell
#: would); switch (on or off); hosts (HOST[:ENGINES],...); port; ip (an address of this machine);
#: mapping (a dict, Python only)
KINDS = (
    "text",
    "count",
    "count0",
    "amount",
    "choice",
    "args",
    "switch",
    "hosts",
    "port",
    "ip",
    "mapping",
)


@dataclass(frozen=True)
class Option:
    """One setting a launcher takes, declared once in its module (`OPTIONS`).

    The `%nbtrain start` flag and its help group, the checks of `nbtrain.start(launcher=..., name=...)`
    (`check_value`), the picker's field and the options table in docs/magics.md are all made from
    this. Launchers that take the same name each declare it (their help may differ); they share one
    flag.
    """

    name: str  #: the Python name: nbtrain.start(name=...), LaunchOptions.name
    help: str  #: one line: the flag's help, the picker field's tooltip, the docs table's meaning
    kind: str = "text"  #: how the value is checked (`KINDS`)
    default: Any = None  #: the value when not given (None: the launcher decides; see `default_doc`)
    choices: tuple[str, ...] = ()  #: kind "choice": the values, the first the default
    flag: str | None = ""  #: "" for --name-with-dashes; None: Python only (no flag, no field)
    example: str = ""  #: a value that works, for messages: "--nodes 2"
    metavar: str = ""  #: the value's name in --help and the docs ("" : the name in capitals)
    default_doc: str = ""  #: the default as the docs table says it (else `default`)
    doc: str = ""  #: the docs table's meaning, where it says more than `help`
    label: str = ""  #: the picker field's label ("" : no field of its own on the picker)
    placeholder: str = ""  #: the picker: what an empty field means
    #: more than the kind checks: takes the value (kind-checked) and returns it normalised, or raises
    #: ConfigError
    check: Callable[[Any], Any] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            msg = f"option {self.name}: kind {self.kind!r} is not one of {', '.join(KINDS)}"
            raise ValueError(msg)
        if self.kind == "choice" and not self.choices:
            msg = f"option {self.name}: kind 'choice' needs its choices"
            raise ValueError(msg)

    @property
    def cli(self) -> str | None:
        """The flag on the command line (`--gpus-per-node`), None where the option has none."""
        if self.flag is None:
            return None
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def named(self) -> str:
        """How messages name it: its flag, else its Python name."""
        return self.cli or self.name


def not_given(value: Any) -> bool:
    """None, or an empty string, list or dict: the option was left out."""
    return value is None or (isinstance(value, (str, list, tuple, dict)) and not value)


def empty(opt: Option) -> Any:
    """The value of an option left out where it does not apply: [] for arguments and hosts, {} for a
    mapping, False for a switch, else None."""
    return {"args": [], "hosts": [], "mapping": {}, "switch": False}.get(opt.kind)


def check_value(opt: Option, value: Any) -> Any:
    """`value` for option `opt`, checked and normalised by its kind (and its own `check`); None
    stays None. A wrong value is a ConfigError naming the flag and a value that works."""
    if value is None:
        return None
    flag, example = opt.named, opt.example
    kind = opt.kind
    if kind in ("count", "count0"):
        value = positive(value, flag, example or "2", minimum=1 if kind == "count" else 0)
    elif kind == "amount":
        value = amount(value, flag, example or "1")
    elif kind == "choice":
        wanted = str(value).strip().upper().replace("-", "_")
        found = [c for c in opt.choices if c.upper().replace("-", "_") == wanted]
        if not found:
            msg = f"{flag} {value!r}: choose one of {', '.join(opt.choices)}."
            raise ConfigError(msg)
        value = found[0]
    elif kind == "args":
        value = shlex.split(value) if isinstance(value, str) else [str(a) for a in value]
    elif kind == "switch":
        value = bool(value)
    elif kind == "hosts":
        value = net.parse_hosts(value) if isinstance(value, str) else list(value)
    elif kind == "port":
        try:
            port = int(value)
        except (TypeError, ValueError):
            port = -1
        if isinstance(value, bool) or not 0 < port < 65536:
            msg = f"{flag} {value} is not a TCP port; give one from 1 to 65535, or leave it out."
            raise ConfigError(msg)
        value = port
    elif kind == "ip":
        value = check_ip(str(value).strip(), flag)
    elif kind == "mapping":
        if not isinstance(value, dict):
            msg = f"{flag} takes a dict, got {type(value).__name__}."
            raise ConfigError(msg)
    elif kind == "text":
        value = str(value).strip()
    return opt.check(value) if opt.check is not None else value


def check_ip(ip: str, flag: str = "--ip") -> str:
    """`ip` if it is an address of this machine, else a ConfigError listing this machine's."""
    try:
        ipaddress.ip_address(ip)
    except ValueError:
        msg = f"{flag} {ip!r} is not an IP address; give an address of this machine."
        raise ConfigError(msg) from None
    if ip not in net.local_addresses():
        mine = ", ".join(
            f"{i.name} {a}" for i in net.interfaces() for a in i.ipv4 if not i.loopback
        )
        msg = f"{flag} {ip} is not an address of this machine; its addresses: {mine}."
        raise ConfigError(msg)
    return ip


def positive(value: Any, flag: str, example: str, minimum: int = 1) -> int:
    """`value` as a whole number >= `minimum`, else a ConfigError: "--nodes 'x' is not a whole
    number at least 1; e.g. --nodes 2"."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = float("nan")
    if isinstance(value, bool) or number != number or number != int(number) or number < minimum:
        least = "at least 1" if minimum else "0 or more"
        msg = f"{flag} {value!r} is not a whole number {least}; e.g. {flag} {example}."
        raise ConfigError(msg)
    return int(number)


def amount(value: Any, flag: str, example: str) -> float:
    """`value` as a number >= 0, else a ConfigError naming the flag and an example."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = float("nan")
    if isinstance(value, bool) or number != number or number < 0:
        msg = f"{flag} {value!r} is not a number of 0 or more; e.g. {flag} {example}."
        raise ConfigError(msg)
    return number


def check_launch(
    launcher: str, given: dict[str, Any], declared: dict[str, tuple[Option, ...]], hint: str = ""
) -> dict[str, Any]:
    """Every option `declared` (launcher -> its options) as `launcher` gets it from `given`: each
    of its own checked (`check_value`) or its default, every other launcher's None.

    A setting no launcher declares, or another launcher's setting given a value, is a ConfigError
    that names it, the launchers it belongs to and, from `hint`, what to give instead.
    """
    if launcher not in declared:
        msg = f"unknown launcher {launcher!r}; choose one of {', '.join(declared)}."
        raise ConfigError(msg)
    mine = {o.name: o for o in declared[launcher]}
    owners: dict[str, list[str]] = {}
    for name, opts in declared.items():
        for o in opts:
            owners.setdefault(o.name, []).append(name)
    unknown = sorted(set(given) - set(owners))
    if unknown:
        known = ", ".join(sorted(mine))
        msg = f"unknown setting(s) for launcher {launcher!r}: {', '.join(unknown)}; known: {known}."
        raise ConfigError(msg)
    for name, value in given.items():
        if name in mine or not_given(value) or value is False:
            continue
        theirs = [o for x in owners[name] for o in declared[x] if o.name == name]
        if any(value == o.default for o in theirs):
            continue  # another launcher's default, passed along: nothing was asked of this one
        which = " or ".join(f"--launcher {x}" for x in owners[name])
        with_this = f"; with --launcher {launcher}, {hint}" if hint else ""
        msg = f"{theirs[0].named} is a setting of {which}, not of --launcher {launcher}{with_this}."
        raise ConfigError(msg)
    # another launcher's options read as left out: empty lists and dicts, off, None
    values: dict[str, Any] = {
        name: empty(next(o for o in declared[who[0]] if o.name == name))
        for name, who in owners.items()
    }
    for name, o in mine.items():
        value = given.get(name)
        if value is None:
            value = copy.copy(o.default)
        values[name] = check_value(o, value) if value is not None else empty(o)
    return values


# -- the Slurm and MPI settings --------------------------------------------------------------

COMMANDS = ("sbatch", "squeue", "scancel")
# sbatch's --time: minutes, minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes,
# days-hours:minutes:seconds (man sbatch)
_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")


def check_time(value: str) -> str:
    """`value` if it is a time limit sbatch takes (02:00:00, 90, 1-12:00:00, UNLIMITED), else a
    ConfigError saying which forms are."""
    text = str(value).strip()
    if text.upper() in ("UNLIMITED", "INFINITE"):
        return text
    m = _TIME.fullmatch(text)
    ok = m is not None
    if m is not None:
        days, first, *rest = m.groups()
        given = [int(x) for x in rest if x is not None]
        # the last two fields of h:m:s / m:s / d-h:m(:s) are minutes and seconds
        if days is not None:
            ok = int(first) < 24 and all(x < 60 for x in given)
        elif len(given) == 2:
            ok = all(x < 60 for x in given)
        elif len(given) == 1:
            ok = given[0] < 60
    if not ok:
        msg = (
            f"--time {value!r} is not a Slurm time limit. Write minutes (90), hours:minutes:seconds "
            "(02:00:00) or days-hours:minutes:seconds (1-12:00:00)."
        )
        raise ConfigError(msg)
    return text


def require_commands(names: tuple[str, ...] = COMMANDS) -> None:
    """Slurm's client commands must be here: this machine submits the job and watches it."""
    missing = [c for c in names if shutil.which(c) is None]
    if missing:
        msg = (
            f"--launcher slurm needs Slurm's commands on this machine, and {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not on PATH. Run the notebook on the cluster's "
            "login node (or a node that can submit jobs), load the Slurm module (module load slurm), "
            "or install Slurm's client set up for your cluster (Debian: apt install slurm-client). "
            "Nothing was started."
        )
        raise ConfigError(msg)


def engines_per_node(lo: Any) -> int:
    """One engine per GPU where GPUs are asked for, else `--engines-per-node` (default 1)."""
    if lo.engines_per_node is not None:
        return int(lo.engines_per_node)
    return max(1, int(lo.gpus_per_node or 0))


def idle_timeout() -> float:
    """Seconds a cluster with no kernel and no job may idle: $NBTRAIN_IDLE_TIMEOUT, default 30 min."""
    raw = os.environ.get(IDLE_ENV)
    if not raw:
        return DEFAULT_IDLE
    try:
        value = float(raw)
    except ValueError:
        msg = f"{IDLE_ENV}={raw!r} is not a number of seconds; e.g. {IDLE_ENV}=1800 (30 min)."
        raise ConfigError(msg) from None
    return value if value > 0 else DEFAULT_IDLE
