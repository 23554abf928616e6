"""The settings of a start, checked where they enter: `StartOptions`, `LaunchOptions`, the registry.

A primitive: plain dataclasses and their checks, nothing started. Every check runs before any engine
does; a wrong value is a `ConfigError` naming the flag and a value that works.

The launcher registry is `LAUNCHERS` below: one line per launcher, name -> its module under
`nbtrain.cluster.launch` (imported only when a start uses it). A new launcher is one new module there
and one line here (plus its settings in `LaunchOptions`, if it takes any).
"""

from __future__ import annotations

import ipaddress
import os
import re
import shlex
import shutil
import sys
from dataclasses import dataclass, field, fields
from typing import Any

from nbtrain import net
from nbtrain.cluster import allocator
from nbtrain.engine import setup
from nbtrain.errors import ConfigError

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
STARTABLE = tuple(name for name in LAUNCHERS if name != "connect")  # what --launcher takes
LAUNCH_HOST_ENV = "NBTRAIN_LAUNCH_HOST"
MPIEXEC = "mpiexec"

# the idle watchdog's limit (nbtrain.cluster.watchdog)
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


# the settings each launcher takes besides the shared ones (ip, iface, port, allow_version_mismatch,
# remote_python); giving another launcher's setting is an error, not silently ignored
_ONLY = {
    "hosts": ("ssh", "mpi"),
    "ssh_args": ("ssh",),
    "host_env": ("ssh",),
    "nodes": ("slurm", "ray"),
    "gpus_per_node": ("slurm",),
    "engines_per_node": ("slurm", "ray"),
    "partition": ("slurm",),
    "account": ("slurm",),
    "time": ("slurm",),
    "slurm_args": ("slurm",),
    "n": ("local", "mpi", "ray"),
    "mpi_args": ("mpi",),
    "address": ("ray",),
    "placement": ("ray",),
    "gpus_per_rank": ("ray",),
    "cpus_per_rank": ("ray",),
}
_FLAG_HINT = {
    "ssh": "give the engines per host in --hosts (node1:2,node2:2)",
    "slurm": "give --nodes and --gpus-per-node (or --engines-per-node)",
    "mpi": "give the ranks with -n (and --hosts for several hosts)",
    "ray": "give -n (or --nodes and --engines-per-node), --gpus-per-rank and --placement",
}


def _flag(name: str) -> str:
    return "-n" if name == "n" else "--" + name.replace("_", "-")


@dataclass
class LaunchOptions:
    """Settings of a multi-node start (`%nbtrain start --launcher ssh|slurm|mpi|ray ...`), validated on entry."""

    launcher: str = "ssh"  # ssh, slurm, mpi or ray
    hosts: Any = (
        None  # "node1:2,node2:2" or a list of net.HostSpec; engines default to the GPU count
    )
    ip: str | None = None  # the controller's listen address (default: the one routing to the hosts)
    iface: str | None = (
        None  # interface for NCCL/gloo on every node (default: the one reaching rank 0)
    )
    port: int | None = None  # rendezvous (MASTER_PORT) on rank 0's host (default: a free one)
    allow_version_mismatch: bool = False  # start although torch/NCCL/nbtrain differ across nodes
    ssh_args: list[str] = field(default_factory=list)  # extra ssh arguments, e.g. ["-F", "cfg"]
    remote_python: str = sys.executable  # the Python on every host that has nbtrain installed
    host_env: dict[str, dict[str, str]] = field(default_factory=dict)  # env for one host's engines
    nodes: int | None = None  # slurm: nodes to allocate (default 1)
    gpus_per_node: int | None = None  # slurm: GPUs per node (--gpus-per-node); one engine per GPU
    engines_per_node: int | None = None  # slurm: engines per node (default: gpus_per_node, else 1)
    partition: str | None = None  # slurm: partition (default: the cluster's default partition)
    account: str | None = None  # slurm: account to charge
    time: str | None = None  # slurm: time limit, e.g. 02:00:00 or 1-00:00:00
    slurm_args: list[str] = field(default_factory=list)  # slurm: more sbatch options, one per line
    n: int | None = None  # mpi: ranks (mpiexec -n; default: the slots in --hosts, else 1)
    mpi_args: list[str] = field(default_factory=list)  # mpi: more mpiexec arguments
    address: str | None = None  # ray: auto (this machine's Ray cluster), local, or ray://head:10001
    placement: str | None = None  # ray: PACK (default), SPREAD, STRICT_PACK or STRICT_SPREAD
    gpus_per_rank: float | None = None  # ray: GPUs in each rank's bundle (default 0: CPU ranks)
    cpus_per_rank: float | None = None  # ray: CPUs in each rank's bundle (default 1)

    def __post_init__(self) -> None:
        if self.launcher == "local":
            msg = (
                "hosts, ip, iface, port and the other multi-node settings need launcher='ssh', "
                "'slurm' or 'mpi' (%nbtrain start --launcher ssh --hosts ...)."
            )
            raise ConfigError(msg)
        if self.launcher not in LAUNCHERS or self.launcher == "connect":
            msg = f"unknown launcher {self.launcher!r}; choose one of {', '.join(STARTABLE)}."
            raise ConfigError(msg)
        defaults = LaunchOptions.__dataclass_fields__
        for name, launchers in _ONLY.items():
            value = getattr(self, name)
            default = defaults[name].default
            if self.launcher not in launchers and value not in (None, [], {}, "", default):
                which = " or ".join(f"--launcher {x}" for x in launchers)
                msg = (
                    f"{_flag(name)} is a setting of {which}, not of --launcher {self.launcher}; "
                    f"with --launcher {self.launcher}, {_FLAG_HINT[self.launcher]}."
                )
                raise ConfigError(msg)
        for name in ("ssh_args", "slurm_args", "mpi_args"):
            if isinstance(getattr(self, name), str):
                setattr(self, name, shlex.split(getattr(self, name)))
        if self.launcher == "ssh" and self.hosts is None:
            msg = "--launcher ssh needs --hosts, e.g. --hosts node1:2,node2:2"
            raise ConfigError(msg)
        if isinstance(self.hosts, str):
            self.hosts = net.parse_hosts(self.hosts)
        else:
            self.hosts = list(self.hosts or [])
        if self.port is not None and not 0 < int(self.port) < 65536:
            msg = (
                f"--port {self.port} is not a TCP port; give one from 1 to 65535, or leave it out."
            )
            raise ConfigError(msg)
        if self.ip is not None:
            try:
                ipaddress.ip_address(self.ip)
            except ValueError:
                msg = f"--ip {self.ip!r} is not an IP address; give an address of this machine."
                raise ConfigError(msg) from None
            if self.ip not in net.local_addresses():
                mine = ", ".join(
                    f"{i.name} {a}" for i in net.interfaces() for a in i.ipv4 if not i.loopback
                )
                msg = f"--ip {self.ip} is not an address of this machine; its addresses: {mine}."
                raise ConfigError(msg)
        if self.launcher == "slurm":
            validate_slurm(self)
        elif self.launcher == "mpi":
            validate_mpi(self)
        elif self.launcher == "ray":
            validate_ray(self)
        for h in self.hosts:
            net.resolve(h.host)  # an unknown host fails here, naming it, before anything starts
        known = {h.host for h in self.hosts}
        for host in self.host_env:
            if host not in known:
                msg = f"host_env names {host!r}, which is not in --hosts ({', '.join(known)})."
                raise ConfigError(msg)


def parse_launch(launcher: str, kwargs: dict[str, Any]) -> LaunchOptions:
    """LaunchOptions from `nbtrain.start(launcher=..., **kwargs)`; unknown settings are an error."""
    names = {f.name for f in fields(LaunchOptions)} - {"launcher"}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        msg = f"unknown setting(s) for launcher {launcher!r}: {', '.join(unknown)}; known: {', '.join(sorted(names))}."
        raise ConfigError(msg)
    return LaunchOptions(launcher=launcher, **kwargs)


# -- the Slurm and MPI settings --------------------------------------------------------------

COMMANDS = ("sbatch", "squeue", "scancel")
# sbatch's --time: minutes, minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes,
# days-hours:minutes:seconds (man sbatch)
_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")
_NAME = re.compile(r"[A-Za-z0-9_.+-]+(?:,[A-Za-z0-9_.+-]+)*")


def _positive(value: Any, flag: str, example: str, minimum: int = 1) -> int:
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = float("nan")
    if isinstance(value, bool) or number != number or number != int(number) or number < minimum:
        least = "at least 1" if minimum else "0 or more"
        msg = f"{flag} {value!r} is not a whole number {least}; e.g. {flag} {example}."
        raise ConfigError(msg)
    return int(number)


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


def validate_slurm(lo: LaunchOptions) -> None:
    """Check and normalise the Slurm settings of `lo`, before anything runs."""
    lo.nodes = 1 if lo.nodes is None else _positive(lo.nodes, "--nodes", "2")
    if lo.gpus_per_node is not None:
        lo.gpus_per_node = _positive(lo.gpus_per_node, "--gpus-per-node", "4", minimum=0)
    if lo.engines_per_node is not None:
        lo.engines_per_node = _positive(lo.engines_per_node, "--engines-per-node", "2")
    if lo.gpus_per_node and lo.engines_per_node and lo.engines_per_node > lo.gpus_per_node:
        msg = (
            f"--engines-per-node {lo.engines_per_node} is more than --gpus-per-node "
            f"{lo.gpus_per_node}; NCCL needs one GPU per engine. Leave --engines-per-node out (one "
            "engine per GPU), or use --backend gloo with no --gpus-per-node."
        )
        raise ConfigError(msg)
    for flag, value in (("--partition", lo.partition), ("--account", lo.account)):
        if value is not None and not _NAME.fullmatch(str(value)):
            msg = (
                f"{flag} {value!r} is not a Slurm name (letters, digits, _ . + -; a comma-separated "
                f"list for several partitions). `sinfo -s` lists the partitions, "
                "`sacctmgr show assoc user=$USER` your accounts."
            )
            raise ConfigError(msg)
    if lo.time is not None:
        lo.time = check_time(lo.time)
    for arg in lo.slurm_args:
        if not arg.startswith("-") or "\n" in arg:
            msg = (
                f"--slurm-args {arg!r}: each one is an sbatch option such as --qos=high or "
                "--constraint=a100, written as `--option=value`."
            )
            raise ConfigError(msg)
    require_commands()


def engines_per_node(lo: LaunchOptions) -> int:
    """One engine per GPU where GPUs are asked for, else `--engines-per-node` (default 1)."""
    if lo.engines_per_node is not None:
        return int(lo.engines_per_node)
    return max(1, int(lo.gpus_per_node or 0))


def validate_mpi(lo: LaunchOptions) -> None:
    """Check the MPI settings of `lo` and settle the rank count, before anything runs."""
    if any(h.user for h in lo.hosts):
        msg = (
            "--launcher mpi takes host names without user@ (mpiexec logs in as you); set the user "
            "for those hosts in ~/.ssh/config instead."
        )
        raise ConfigError(msg)
    slots = sum(h.engines or 1 for h in lo.hosts)
    if lo.n is None:
        lo.n = slots or 1
    elif lo.hosts and int(lo.n) != slots:
        listed = ",".join(f"{h.host}:{h.engines or 1}" for h in lo.hosts)
        msg = (
            f"-n {lo.n} does not match --hosts {listed} ({slots} rank(s)); give the ranks per host "
            "in --hosts and leave -n out, or make them agree."
        )
        raise ConfigError(msg)
    if shutil.which(MPIEXEC) is None:
        msg = (
            f"--launcher mpi needs {MPIEXEC} on PATH, and there is none on this machine. Install an "
            "MPI (Debian: apt install openmpi-bin, or mpich) or load its module (module load "
            "openmpi), then start again. Nothing was started."
        )
        raise ConfigError(msg)


# -- the Ray settings --------------------------------------------------------------------------

PLACEMENTS = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def _amount(value: Any, flag: str, example: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = float("nan")
    if isinstance(value, bool) or number != number or number < 0:
        msg = f"{flag} {value!r} is not a number of 0 or more; e.g. {flag} {example}."
        raise ConfigError(msg)
    return number


def validate_ray(lo: LaunchOptions) -> None:
    """Check and normalise the Ray settings of `lo`: address, placement, ranks and their bundles.

    Ranks come from -n, or from --nodes and --engines-per-node (one bundle per node holding that
    node's ranks, the nodes STRICT_SPREAD; --placement then says how a node's ranks sit: PACK or
    STRICT_PACK, the only ways a node's ranks can share one bundle).
    """
    address = (lo.address or "auto").strip()
    if address not in ("auto", "local") and not re.fullmatch(
        r"(ray://)?[\w.\-\[\]:]+:\d+", address
    ):
        msg = (
            f"--address {lo.address!r} is not a Ray address. Give auto (the Ray cluster this "
            "machine belongs to), local (a private one-machine Ray cluster, stopped with nbtrain's) "
            "or ray://HEAD:10001 (a remote head's Ray Client port)."
        )
        raise ConfigError(msg)
    lo.address = address
    placement = str(lo.placement or "PACK").upper().replace("-", "_")
    if placement not in PLACEMENTS:
        msg = f"--placement {lo.placement!r}: choose one of {', '.join(PLACEMENTS)}."
        raise ConfigError(msg)
    lo.placement = placement
    lo.gpus_per_rank = _amount(lo.gpus_per_rank or 0, "--gpus-per-rank", "1")
    cpus = 1.0 if lo.cpus_per_rank is None else lo.cpus_per_rank
    lo.cpus_per_rank = _amount(cpus, "--cpus-per-rank", "2")
    if lo.gpus_per_rank > 1 and lo.gpus_per_rank != int(lo.gpus_per_rank):
        msg = f"--gpus-per-rank {lo.gpus_per_rank:g}: above 1, give a whole number of GPUs."
        raise ConfigError(msg)
    if lo.nodes is not None or lo.engines_per_node is not None:
        lo.nodes = 1 if lo.nodes is None else _positive(lo.nodes, "--nodes", "2")
        per = 1 if lo.engines_per_node is None else lo.engines_per_node
        lo.engines_per_node = _positive(per, "--engines-per-node", "4")
        total = lo.nodes * lo.engines_per_node
        if lo.n is not None and int(lo.n) != total:
            msg = (
                f"-n {lo.n} does not match --nodes {lo.nodes} x --engines-per-node "
                f"{lo.engines_per_node} ({total} ranks); give one or the other."
            )
            raise ConfigError(msg)
        if lo.placement not in ("PACK", "STRICT_PACK"):
            msg = (
                f"--placement {lo.placement} with --nodes: each node's ranks share one bundle on one "
                "node, and the nodes are always STRICT_SPREAD. Use --placement STRICT_PACK (or "
                f"leave it out), or give -n {total} without --nodes to {lo.placement} single ranks."
            )
            raise ConfigError(msg)
        lo.n = total
    lo.n = _positive(1 if lo.n is None else lo.n, "-n", "4")


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
