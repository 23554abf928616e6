"""The picker's settings: what it starts (`PickerSettings`), where they are remembered, their
validation, and the call into the Python API they make (`start_cluster`).

Plain functions, testable without a browser. The last settings are saved per user in
``$NBTRAIN_HOME/picker.json`` (default ``~/.local/share/nbtrain/picker.json``) and restored the next
time.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from nbtrain import atomic
from nbtrain.errors import NbtrainError

log = logging.getLogger(__name__)

# widget value -> label, for the launchers with a page of their own (MPI is started with
# %nbtrain start --launcher mpi; the picker has no page for it). A launcher whose module names a
# `LABEL` gets a page made from its declared options (`launchers()`).
PAGES = {
    "local": "this machine",
    "ssh": "SSH hosts",
    "slurm": "Slurm",
    "ray": "Ray cluster",
    "connect": "existing cluster",
}
LAUNCHERS = PAGES  # the launchers with pages of their own, as before


def launchers() -> dict[str, str]:
    """Every launcher the picker shows (value -> label): those with pages of their own, then any
    registered launcher whose module has a `LABEL`, on a page made from its options."""
    from nbtrain.cluster import launch
    from nbtrain.cluster.options import startable

    out = dict(PAGES)
    for name in startable():
        label = getattr(launch.launcher_module(name), "LABEL", None)
        if name not in out and label:
            out[name] = label
    return out


# the form's shared fields: option -> the PickerSettings field that holds it (iface "auto" and
# empty texts are left out, so the launcher's own default applies)
SHARED_FIELDS = {
    "ip": "ip",
    "iface": "iface",
    "port": "port",
    "allow_version_mismatch": "allow_version_mismatch",
    "remote_python": "python",
}


def setting(s: PickerSettings, launcher: str, name: str) -> Any:
    """Option `name` of `launcher` as the settings hold it: its own field, else `s.options`."""
    if name in SHARED_FIELDS:
        return getattr(s, SHARED_FIELDS[name])
    if name in {f.name for f in fields(PickerSettings)}:
        return getattr(s, name)
    return s.options.get(launcher, {}).get(name)


def launch_settings(s: PickerSettings, launcher: str, names: Any = None) -> dict[str, Any]:
    """The options `launcher` declares (all, or `names`) as `nbtrain.start(launcher=...)` takes them:
    only those given, so the launcher's defaults (and Slurm's, Ray's) stay the defaults. Options
    with a picker field (a label), and the form's shared fields; the ranks of the Ray page are the
    page's own (`ray_launch`)."""
    from nbtrain.cluster import launch

    given: dict[str, Any] = {}
    for o in launch.declared()[launcher]:
        if not (o.label or o.name in SHARED_FIELDS) or (names is not None and o.name not in names):
            continue
        value = setting(s, launcher, o.name)
        if isinstance(value, str):
            value = value.strip()
        if o.name == "iface" and value == AUTO:
            value = None
        if value is None or value is False or (isinstance(value, str) and not value):
            continue
        given[o.name] = value
    return given


# the Ray page's two ways to give the ranks (--launcher ray takes one or the other)
RAY_RANKS = {"n": "ranks (-n)", "nodes": "nodes x engines per node"}
BACKENDS = ("auto", "gloo", "nccl")
AUTO = "auto"


@dataclass
class PickerSettings:
    """What the picker starts; the same settings as `%nbtrain start` / `%nbtrain connect`."""

    launcher: str = "local"  # local, ssh, slurm, ray, connect (an existing ipyparallel cluster)
    n: int = 1  # engines on this machine (launcher local)
    hosts: str = ""  # HOST[:ENGINES],... (launcher ssh), e.g. node1:2,node2:2
    backend: str = "auto"  # auto (NCCL where every rank has a GPU, else gloo), gloo or nccl
    iface: str = AUTO  # NCCL/gloo interface on every node, or auto (the one reaching rank 0)
    ip: str = ""  # the controller's listen address, which the hosts reach (empty: automatic)
    port: int | None = None  # rendezvous port (MASTER_PORT) on rank 0's host (None: a free one)
    profile: str = ""  # IPython profile of an existing cluster (launcher connect)
    cluster_id: str = ""  # ipyparallel cluster id of an existing cluster (launcher connect)
    timeout: float = 120.0  # seconds to get every engine and the process group
    allow_version_mismatch: bool = False  # start although torch/NCCL/nbtrain differ across nodes
    python: str = ""  # the Python with nbtrain on every host (empty: this kernel's path), --python
    ssh_args: str = ""  # extra ssh arguments, e.g. "-F ~/.ssh/cluster", --ssh-args
    # launcher slurm: the magic's --nodes, --gpus-per-node, ... (None or "": not given, Slurm's or
    # nbtrain's default applies)
    nodes: int = 1  # nodes of the job, --nodes
    gpus_per_node: int | None = None  # GPUs per node, one engine each, --gpus-per-node (None: CPU)
    engines_per_node: int | None = None  # engines per node, --engines-per-node (None: GPUs, else 1)
    partition: str = ""  # --partition (empty: the cluster's default partition)
    account: str = ""  # --account to charge (empty: your default account)
    time: str = ""  # --time limit, e.g. 02:00:00 (empty: the partition's default)
    slurm_args: str = ""  # more sbatch options, e.g. "--qos=high" one per line, --slurm-args
    # launcher ray: the magic's --address, -n or --nodes x --engines-per-node, --gpus-per-rank, ...
    # (the ranks are the page's own fields: the Local and Slurm pages keep theirs)
    address: str = "auto"  # --address: auto, local, or ray://HEAD:10001
    ray_ranks_by: str = "n"  # n (-n ranks) or nodes (--nodes x --engines-per-node)
    ray_n: int = 1  # ranks, -n (ray_ranks_by n)
    ray_nodes: int | None = None  # --nodes, one bundle each (ray_ranks_by nodes; None: 1)
    ray_engines_per_node: int | None = None  # --engines-per-node (ray_ranks_by nodes; None: 1)
    gpus_per_rank: float | None = None  # --gpus-per-rank (None: 0, CPU ranks)
    cpus_per_rank: float | None = None  # --cpus-per-rank (None: 1)
    placement: str = "PACK"  # --placement: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD
    # launcher -> option -> value, for the options a launcher declares that have no field above (a
    # new option, or a launcher with no page of its own): its page is made from the declarations
    options: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PickerSettings:
        """Settings from saved JSON; unknown keys (from another nbtrain version) are ignored."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


# -- remembered settings ---------------------------------------------------------------------------


def settings_path() -> Path:
    """Where the picker's last settings live: $NBTRAIN_HOME/picker.json, else ~/.local/share/nbtrain."""
    from nbtrain.runs import nbtrain_home

    return nbtrain_home() / "picker.json"


def save_settings(settings: PickerSettings, path: Path | None = None) -> Path:
    """Write the settings as JSON (atomically: a crash never leaves half a file)."""
    path = path or settings_path()
    atomic.write_json(path, asdict(settings), indent=2)
    return path


def load_settings(path: Path | None = None) -> PickerSettings:
    """The last saved settings, or the defaults when there are none (or the file is unreadable)."""
    path = path or settings_path()
    try:
        return PickerSettings.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return PickerSettings()
    except (OSError, ValueError, TypeError) as e:
        log.warning("nbtrain: ignoring unreadable picker settings %s: %s", path, e)
        return PickerSettings()


# -- validation ------------------------------------------------------------------------------------


def validate(s: PickerSettings) -> dict[str, str]:
    """Field name -> what is wrong with it (empty when the settings can start a cluster).

    The checks are the API's own (`net.parse_hosts`, the port range), run before anything starts.
    """
    from nbtrain import net

    errors: dict[str, str] = {}
    shown = launchers()
    if s.launcher not in shown:
        errors["launcher"] = f"unknown launcher {s.launcher!r}; choose one of {', '.join(shown)}."
    if s.backend not in BACKENDS:
        errors["backend"] = f"unknown backend {s.backend!r}; choose one of {', '.join(BACKENDS)}."
    if s.timeout <= 0:
        errors["timeout"] = f"timeout {s.timeout:g} must be a positive number of seconds."
    if s.launcher == "local":
        if isinstance(s.n, bool) or not isinstance(s.n, int) or s.n < 1:
            errors["n"] = f"engines {s.n!r}: start at least one engine on this machine."
    if s.launcher == "ssh":
        try:
            net.parse_hosts(s.hosts)
        except NbtrainError as e:
            errors["hosts"] = str(e)
    if s.launcher in ("ssh", "slurm", "ray", "connect") and s.port is not None:
        if isinstance(s.port, bool) or not isinstance(s.port, int) or not 0 < s.port < 65536:
            errors["port"] = (
                f"port {s.port} is not a TCP port; give one from 1 to 65535, or leave it empty."
            )
    if s.launcher == "slurm":
        errors.update(validate_slurm(s, skip_port="port" in errors))
    if s.launcher == "ray":
        errors.update(validate_ray(s, skip_port="port" in errors))
    if s.launcher in shown and s.launcher not in PAGES:
        errors.update(validate_page(s, skip_port="port" in errors))
    return errors


def validate_page(s: PickerSettings, skip_port: bool = False) -> dict[str, str]:
    """The problems of a page made from a launcher's options, as `LaunchOptions` checks them."""
    from nbtrain.cluster.launch import LaunchOptions
    from nbtrain.errors import ConfigError

    launch = launch_settings(s, s.launcher)
    if skip_port:
        launch.pop("port", None)
    try:
        LaunchOptions(launcher=s.launcher, **launch)
    except ConfigError as e:
        return {s.launcher: str(e)}
    return {}


def validate_slurm(s: PickerSettings, skip_port: bool = False) -> dict[str, str]:
    """The Slurm page's problems: the time limit (`options.check_time`), then the rest as
    `LaunchOptions(launcher="slurm", ...)` checks them (numbers, names, sbatch lines, --ip, and
    that sbatch is on PATH). One message for the rest: LaunchOptions stops at the first."""
    from nbtrain.cluster import options
    from nbtrain.cluster.launch import LaunchOptions
    from nbtrain.errors import ConfigError

    errors: dict[str, str] = {}
    if s.time.strip():
        try:
            options.check_time(s.time)
        except ConfigError as e:
            errors["time"] = str(e)
    launch = slurm_launch(s)
    if "time" in errors:
        launch.pop("time")
    if skip_port:
        launch.pop("port", None)
    try:
        LaunchOptions(launcher="slurm", **launch)
    except ConfigError as e:
        errors["slurm"] = str(e)
    return errors


def validate_ray(s: PickerSettings, skip_port: bool = False) -> dict[str, str]:
    """The Ray page's problems, as `LaunchOptions(launcher="ray", ...)` checks them (the address,
    placement, ranks and each rank's GPUs and CPUs, --ip). Nothing connects to Ray. One message:
    LaunchOptions stops at the first."""
    from nbtrain.cluster.launch import LaunchOptions
    from nbtrain.errors import ConfigError

    launch = ray_launch(s)
    if skip_port:
        launch.pop("port", None)
    try:
        LaunchOptions(launcher="ray", **launch)
    except ConfigError as e:
        return {"ray": str(e)}
    return {}


# -- the call into the API -------------------------------------------------------------------------


def api_call(s: PickerSettings, force: bool = False) -> tuple[str, dict[str, Any]]:
    """Which API function the settings call ('start' or 'connect') and its keyword arguments.

    The same calls `%nbtrain start [--launcher ssh ...]` and `%nbtrain connect` make.
    """
    iface = None if s.iface in ("", AUTO) else s.iface
    if s.launcher == "slurm":
        return "start", {
            "launcher": "slurm",
            **slurm_launch(s),
            "backend": s.backend,
            "timeout": s.timeout,
            "force": force,
        }
    if s.launcher == "ray":
        return "start", {
            "launcher": "ray",
            **ray_launch(s),
            "backend": s.backend,
            "timeout": s.timeout,
            "force": force,
        }
    if s.launcher == "local":
        return "start", {"n": s.n, "backend": s.backend, "timeout": s.timeout, "force": force}
    if s.launcher == "ssh":
        return "start", {
            "launcher": "ssh",
            "hosts": s.hosts,
            "ip": s.ip or None,
            "iface": iface,
            "port": s.port,
            "allow_version_mismatch": s.allow_version_mismatch,
            "backend": s.backend,
            "timeout": s.timeout,
            "force": force,
            # only when given, as the magic does: LaunchOptions' defaults stay the defaults
            **launch_settings(s, "ssh", ("remote_python", "ssh_args")),
        }
    if s.launcher != "connect":  # a launcher whose page is made from its options
        return "start", {
            "launcher": s.launcher,
            **launch_settings(s, s.launcher),
            "backend": s.backend,
            "timeout": s.timeout,
            "force": force,
        }
    return "connect", {
        "cluster_id": s.cluster_id or None,
        "profile": s.profile or None,
        "iface": iface,
        "port": s.port,
        "backend": s.backend,
        "timeout": s.timeout,
        "allow_version_mismatch": s.allow_version_mismatch,
        "force": force,
    }


def slurm_launch(s: PickerSettings) -> dict[str, Any]:
    """The Slurm settings as `nbtrain.start(launcher="slurm", ...)` takes them: only those given,
    so LaunchOptions' defaults (and Slurm's: default partition, account, time) stay the defaults."""
    return launch_settings(s, "slurm")


def ray_launch(s: PickerSettings) -> dict[str, Any]:
    """The Ray settings as `nbtrain.start(launcher="ray", ...)` takes them: the page's options as
    given (the address and placement always have a value), and -n or --nodes x --engines-per-node
    as the page's choice says."""
    by_nodes = s.ray_ranks_by == "nodes"
    ranks: dict[str, Any] = {
        "n": None if by_nodes else s.ray_n,
        # nodes x engines with both empty is one node of one engine (and its placement rules)
        "nodes": (1 if s.ray_nodes is None else s.ray_nodes) if by_nodes else None,
        "engines_per_node": s.ray_engines_per_node if by_nodes else None,
    }
    given = {**launch_settings(s, "ray"), **ranks}
    return {k: v for k, v in given.items() if v is not None}


def start_cluster(s: PickerSettings, force: bool = False) -> Any:
    """Validate the settings, then start (or connect to) the cluster; raise ConfigError if invalid."""
    from nbtrain.errors import ConfigError

    errors = validate(s)
    if errors:
        msg = " ".join(errors.values())
        raise ConfigError(msg)
    name, kwargs = api_call(s, force=force)
    if name == "start":
        from nbtrain.cluster.api import start

        return start(**kwargs)
    from nbtrain.cluster.api import connect

    return connect(**kwargs)


def parse_int(text: str) -> Any:
    """A whole number from a text field; None when empty; the text itself when not a number (the
    validation names it, as the magic would)."""
    text = text.strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        return text


def int_text(value: Any) -> str:
    """A whole number (or None) as a text field shows it: None is empty."""
    return "" if value is None else str(value)


def parse_number(text: str) -> Any:
    """A number (1, 0.5) from a text field; None when empty; the text itself when not a number."""
    text = text.strip()
    if not text:
        return None
    try:
        number = float(text)
    except ValueError:
        return text
    return int(number) if number.is_integer() and "." not in text else number


def number_text(value: Any) -> str:
    """A number (or None) as a text field shows it: None is empty, 1.0 is 1."""
    if value is None:
        return ""
    return f"{value:g}" if isinstance(value, float) else str(value)
