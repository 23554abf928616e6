"""`nbtrain.ClusterPicker()`: start, inspect, probe and stop a cluster from a widget.

In [1]: nbtrain.ClusterPicker()

The widget is thin: the settings (`PickerSettings`), their validation (`validate`), the call into the
Python API (`start_cluster`, the same `nbtrain.start` / `nbtrain.connect` the magics call) and the
tables (`topology_html`, `versions_html`) are plain functions, testable without a browser. The last
settings are saved per user in ``$NBTRAIN_HOME/picker.json`` (default
``~/.local/share/nbtrain/picker.json``) and restored the next time.
"""

from __future__ import annotations

import contextlib
import html
import json
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from nbtrain.errors import NbtrainError

log = logging.getLogger("nbtrain")

# widget value -> label (MPI is started with %nbtrain start --launcher mpi; the picker has no page)
LAUNCHERS = {
    "local": "this machine",
    "ssh": "SSH hosts",
    "slurm": "Slurm",
    "connect": "existing cluster",
}
BACKENDS = ("auto", "gloo", "nccl")
AUTO = "auto"


@dataclass
class PickerSettings:
    """What the picker starts; the same settings as `%nbtrain start` / `%nbtrain connect`."""

    launcher: str = "local"  # local, ssh, slurm, connect (an existing ipyparallel cluster)
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
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(asdict(settings), indent=2))
    tmp.replace(path)
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
    if s.launcher not in LAUNCHERS:
        errors["launcher"] = (
            f"unknown launcher {s.launcher!r}; choose one of {', '.join(LAUNCHERS)}."
        )
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
    if s.launcher in ("ssh", "slurm", "connect") and s.port is not None:
        if isinstance(s.port, bool) or not isinstance(s.port, int) or not 0 < s.port < 65536:
            errors["port"] = (
                f"port {s.port} is not a TCP port; give one from 1 to 65535, or leave it empty."
            )
    if s.launcher == "slurm":
        errors.update(validate_slurm(s, skip_port="port" in errors))
    return errors


def validate_slurm(s: PickerSettings, skip_port: bool = False) -> dict[str, str]:
    """The Slurm page's problems: the time limit (`options.check_time`), then the rest as
    `LaunchOptions(launcher="slurm", ...)` checks them (numbers, names, sbatch lines, --ip, and
    that sbatch is on PATH). One message for the rest: LaunchOptions stops at the first."""
    from nbtrain.cluster import options
    from nbtrain.cluster.options import LaunchOptions
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
            **({"remote_python": s.python} if s.python else {}),
            **({"ssh_args": s.ssh_args} if s.ssh_args else {}),
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
    given: dict[str, Any] = {
        "nodes": s.nodes,
        "gpus_per_node": s.gpus_per_node,
        "engines_per_node": s.engines_per_node,
        "partition": s.partition.strip() or None,
        "account": s.account.strip() or None,
        "time": s.time.strip() or None,
        "slurm_args": s.slurm_args.strip() or None,
        "remote_python": s.python.strip() or None,
        "ip": s.ip.strip() or None,
        "iface": None if s.iface in ("", AUTO) else s.iface,
        "port": s.port,
        "allow_version_mismatch": s.allow_version_mismatch or None,
    }
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


def _parse_int(text: str) -> Any:
    """A whole number from a text field; None when empty; the text itself when not a number (the
    validation names it, as the magic would)."""
    text = text.strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        return text


def _int_text(value: Any) -> str:
    return "" if value is None else str(value)


def error_text(e: BaseException) -> str:
    """The message a user reads: nbtrain's own message, or the exception's type and message."""
    if isinstance(e, NbtrainError):
        return str(e)
    return f"{type(e).__name__}: {e}"


# -- tables ----------------------------------------------------------------------------------------


def topology_html(cluster: Any) -> str:
    """Rank -> host, local rank, device, address, interface, as an HTML table."""
    head = ("rank", "host", "local rank", "device", "address", "interface")
    rows = [
        (r.rank, r.host, r.local_rank, r.device, r.address, r.interface or "-")
        for r in cluster.ranks
    ]
    out = ['<table class="nbtrain-topology"><thead><tr>']
    out += [f"<th>{h}</th>" for h in head]
    out.append("</tr></thead><tbody>")
    for row in rows:
        out.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def versions_html(cluster: Any) -> str:
    """The preflight version table (odd versions highlighted), or '' where the cluster has none.

    Clusters started over SSH or attached with connect ran preflight; local ones did not (one node).
    """
    from nbtrain.cluster.launch import preflight

    result = getattr(cluster, "preflight", None)
    if result is None:
        return ""
    return preflight.format_html(result)


def interface_choices() -> list[str]:
    """'auto' and this machine's interfaces that are up (loopback last)."""
    from nbtrain import net

    return [AUTO, *(i.name for i in net.interfaces())]


# -- the nodes' interfaces -------------------------------------------------------------------------

# host (as in --hosts) -> interface name -> its addresses (IPv4 first), as the hosts report them
NodeInterfaces = dict[str, dict[str, list[str]]]


def check_node_interfaces(
    s: PickerSettings, timeout: float = 30.0
) -> tuple[NodeInterfaces, dict[str, str]]:
    """Log in to every SSH host (in parallel) and ask for its interfaces; nothing is started.

    Returns (host -> interfaces, host -> error message). Each host is asked on its own, so one host
    that cannot be reached does not hide the interfaces of the others, and every failing host is
    named. The login and the question are `nbtrain.cluster.launch.ssh.check_hosts`, the check `nbtrain.start` makes.
    """
    from concurrent.futures import ThreadPoolExecutor

    from nbtrain import net
    from nbtrain.cluster.launch import ssh
    from nbtrain.cluster.options import LaunchOptions

    specs = net.parse_hosts(s.hosts)
    extra: dict[str, Any] = {}
    if s.python:
        extra["remote_python"] = s.python
    if s.ssh_args:
        extra["ssh_args"] = s.ssh_args

    def one(spec: net.HostSpec) -> dict[str, list[str]]:
        # one host per LaunchOptions: an unknown host name fails here, naming that host only
        lo = LaunchOptions(launcher="ssh", hosts=[spec], **extra)
        return ssh.check_hosts(lo, timeout)[spec.host].interfaces

    found: NodeInterfaces = {}
    errors: dict[str, str] = {}
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = {spec.host: pool.submit(one, spec) for spec in specs}
        for host, fut in futures.items():
            try:
                found[host] = {n: list(a) for n, a in fut.result().items()}
            except Exception as e:
                errors[host] = error_text(e)
    return found, errors


def interfaces_from_reports(ranks: Any, reports: Any) -> NodeInterfaces:
    """Host -> interfaces from the preflight reports of a started cluster (one report per rank)."""
    found: NodeInterfaces = {}
    for r, report in zip(ranks, reports or ()):
        if r.host in found or not isinstance(report, dict):
            continue
        nics = report.get("interfaces") or {}
        found[r.host] = {n: list(v.get("addresses", [])) for n, v in nics.items()}
    return found


def _ipv4(addresses: list[str]) -> list[str]:
    return [a for a in addresses if ":" not in a]


def _is_loopback(name: str, addresses: list[str]) -> bool:
    import ipaddress

    if name == "lo":
        return True
    try:
        return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)
    except ValueError:
        return False


def _missing_text(name: str, nodes: NodeInterfaces) -> str:
    """'' when every node has `name` with an IPv4 address, else which node lacks what."""
    absent = [h for h, nics in nodes.items() if name not in nics]
    no_v4 = [h for h, nics in nodes.items() if name in nics and not _ipv4(nics[name])]
    parts = []
    if absent:
        parts.append("not on " + ", ".join(absent))
    if no_v4:
        parts.append("no IPv4 address on " + ", ".join(no_v4))
    return "; ".join(parts)


def node_interface_options(
    nodes: NodeInterfaces, current: str = AUTO, n_hosts: int | None = None
) -> list[tuple[str, str]]:
    """The Interface dropdown's (label, value) pairs for the nodes' interfaces.

    'auto' first, then the interfaces every node has (with an IPv4 address: the process group
    needs one), then those some node lacks, labelled with the node. Loopback is left out when there
    is more than one node (`n_hosts`: the hosts of the cluster, default those in `nodes`; it does
    not connect them), and so are interfaces with no IPv4 address on any node. A `current` choice
    that is not among them stays, labelled as such.
    """
    several = (len(nodes) if n_hosts is None else n_hosts) > 1
    names: list[str] = []
    for nics in nodes.values():
        for name, addresses in nics.items():
            if name in names or not _ipv4(addresses):
                continue
            if several and _is_loopback(name, addresses):
                continue
            names.append(name)
    common = [n for n in names if not _missing_text(n, nodes)]
    partial = [n for n in names if n not in common]
    options = [(AUTO, AUTO)]
    options += [(n, n) for n in common]
    options += [(f"{n} ({_missing_text(n, nodes)})", n) for n in partial]
    if current not in (AUTO, *names):
        why = _missing_text(current, nodes) if nodes else ""
        options.append((f"{current} ({why or 'not found on the nodes'})", current))
    return options


def node_interfaces_html(nodes: NodeInterfaces, source: str, n_hosts: int | None = None) -> str:
    """Each node's interfaces and addresses, and which interface some node lacks, as HTML."""
    if not nodes:
        return ""
    out = [f'<div class="nbtrain-node-ifaces"><small>interfaces of the nodes ({source}):</small>']
    out.append("<table><thead><tr><th>node</th><th>interfaces</th></tr></thead><tbody>")
    for host, nics in nodes.items():
        listed = ", ".join(f"{n} ({', '.join(_ipv4(a))})" for n, a in nics.items() if _ipv4(a))
        out.append(
            f"<tr><td>{html.escape(host)}</td><td>{html.escape(listed or 'none with IPv4')}</td></tr>"
        )
    out.append("</tbody></table>")
    lacking = [
        (n, _missing_text(n, nodes))
        for _, n in node_interface_options(nodes, n_hosts=n_hosts)
        if n != AUTO and _missing_text(n, nodes)
    ]
    for name, why in lacking:
        out.append(f"<div><small>{html.escape(name)}: {html.escape(why)}</small></div>")
    out.append("</div>")
    return "".join(out)


# -- the widget ------------------------------------------------------------------------------------


class _Progress(logging.Handler):
    """The start's progress lines, for the status line next to the elapsed seconds.

    `nbtrain.start` reports each step (the same lines `quiet=False` prints: "slurm job 4711
    pending (Resources)", "rendezvous at ...") on the "nbtrain" logger; this keeps the last one
    logged by the thread that runs the start, so another start or cell in the kernel does not
    show up in this picker. The picker does not pass quiet=False: printing from its worker thread
    would put the lines under whichever cell runs, not in the form.
    """

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.last = ""
        self._thread: int | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread == self._thread and record.levelno == logging.INFO:
            self.last = record.getMessage().removeprefix("nbtrain: ")

    @contextlib.contextmanager
    def from_this_thread(self) -> Iterator[None]:
        self._thread = threading.get_ident()
        old = log.level
        # INFO must reach the handler; the level goes back afterwards
        if log.getEffectiveLevel() > logging.INFO:
            log.setLevel(logging.INFO)
        log.addHandler(self)
        try:
            yield
        finally:
            log.removeHandler(self)
            log.setLevel(old)


class ClusterPicker:
    """A widget to pick a launcher and hosts, start the cluster, see its topology, probe and stop it.

    In [1]: picker = nbtrain.ClusterPicker()     # the settings are last time's
    In [2]: picker                               # a cell's last expression shows the form

    `picker.cluster` is the started `nbtrain.Cluster` (also `nbtrain.current_cluster()`, so
    `%%distributed` cells run on it).
    """

    def __init__(
        self,
        settings: PickerSettings | None = None,
        *,
        remember: bool = True,
        background: bool = True,
        probe_max_bytes: int = 16 * 2**20,
    ) -> None:
        import ipywidgets as w

        self.remember = remember
        self.background = background  # start/probe in a thread so the elapsed time ticks
        self.probe_max_bytes = probe_max_bytes
        self.cluster: Any = None
        self._worker: threading.Thread | None = None
        s = (
            settings
            if settings is not None
            else (load_settings() if remember else PickerSettings())
        )
        style = {"description_width": "150px"}

        self.launcher = w.ToggleButtons(
            options=[(label, k) for k, label in LAUNCHERS.items()],
            value=s.launcher if s.launcher in LAUNCHERS else "local",
            description="Launcher",
            style=style,
        )
        self.n = w.BoundedIntText(
            value=max(1, int(s.n)), min=1, max=1024, description="Engines", style=style
        )
        self.hosts = w.Text(
            value=s.hosts,
            placeholder="node1:2,node2:2",
            description="Hosts:engines",
            style=style,
        )
        self.profile = w.Text(
            value=s.profile, placeholder="default", description="Profile", style=style
        )
        self.cluster_id = w.Text(
            value=s.cluster_id, placeholder="(newest)", description="Cluster id", style=style
        )
        self.backend = w.Dropdown(
            options=list(BACKENDS),
            value=s.backend if s.backend in BACKENDS else "auto",
            description="Backend",
            style=style,
        )
        # filled by _refresh_ifaces: the nodes' interfaces once known (Check hosts, or preflight
        # after a start), until then this machine's (or, for SSH hosts, 'auto' and the saved one)
        self.iface = w.Dropdown(options=[AUTO], value=AUTO, description="Interface", style=style)
        self._saved_iface = s.iface or AUTO
        self.iface_info = w.HTML()
        # the nodes' interfaces and what they belong to: (launcher, hosts or profile/cluster id)
        self._nodes: NodeInterfaces | None = None
        self._nodes_key: tuple[str, ...] | None = None
        self._nodes_hosts = 0  # hosts asked (some may not have answered)
        self.ip = w.Text(
            value=s.ip,
            placeholder="auto (routes to the hosts)",
            description="Controller address",
            style=style,
        )
        self.port = w.Text(
            value="" if s.port is None else str(s.port),
            placeholder="auto (a free port)",
            description="Rendezvous port",
            style=style,
        )
        self.python = w.Text(
            value=s.python,
            placeholder="this kernel's Python path",
            description="Python on hosts",
            style=style,
        )
        self.ssh_args = w.Text(
            value=s.ssh_args,
            placeholder="e.g. -F ~/.ssh/cluster",
            description="ssh arguments",
            style=style,
        )
        # the Slurm page: what is left empty is not passed (Slurm's or nbtrain's default applies)
        self.nodes = w.IntText(value=int(s.nodes), description="Nodes", style=style)
        self.gpus_per_node = w.Text(
            value=_int_text(s.gpus_per_node),
            placeholder="none (CPU nodes)",
            description="GPUs per node",
            style=style,
        )
        self.engines_per_node = w.Text(
            value=_int_text(s.engines_per_node),
            placeholder="one per GPU, else 1",
            description="Engines per node",
            style=style,
        )
        self.partition = w.Text(
            value=s.partition,
            placeholder="the default partition",
            description="Partition",
            style=style,
        )
        self.account = w.Text(
            value=s.account, placeholder="your default account", description="Account", style=style
        )
        self.time = w.Text(
            value=s.time,
            placeholder="the partition's default, e.g. 02:00:00",
            description="Time limit",
            style=style,
        )
        self.slurm_args = w.Textarea(
            value=s.slurm_args,
            placeholder="--qos=high\n--constraint=a100",
            description="Extra sbatch lines",
            rows=2,
            style=style,
        )
        self.timeout = w.BoundedFloatText(
            value=s.timeout, min=1, max=3600, description="Timeout (s)", style=style
        )
        self.allow_mismatch = w.Checkbox(
            value=s.allow_version_mismatch, description="Allow version mismatch", indent=False
        )
        self.check_button = w.Button(
            description="Check hosts",
            icon="search",
            tooltip="log in to the hosts over SSH and list their network interfaces",
        )
        self.start_button = w.Button(description="Start", button_style="primary", icon="play")
        self.probe_button = w.Button(description="Probe", icon="tachometer", disabled=True)
        self.stop_button = w.Button(
            description="Stop", button_style="danger", icon="stop", disabled=True
        )
        self.status = w.HTML()
        self.error = w.HTML()
        self.topology = w.HTML()
        self.versions = w.HTML()
        self.probe_out = w.HTML()

        self._ssh_box = w.VBox([self.hosts, self.ssh_args, self.check_button])
        self._slurm_box = w.VBox(
            [
                self.nodes,
                self.gpus_per_node,
                self.engines_per_node,
                self.partition,
                self.account,
                self.time,
                self.slurm_args,
            ]
        )
        # what SSH hosts and Slurm nodes share: the controller's address here, their Python
        self._engines_remote = w.VBox([self.ip, self.python])
        self._local_box = w.VBox([self.n])
        self._connect_box = w.VBox([self.profile, self.cluster_id])
        self._shared_remote = w.VBox([self.iface, self.iface_info, self.port, self.allow_mismatch])
        self.widget = w.VBox(
            [
                self.launcher,
                self._local_box,
                self._ssh_box,
                self._slurm_box,
                self._engines_remote,
                self._connect_box,
                self.backend,
                self._shared_remote,
                self.timeout,
                w.HBox([self.start_button, self.probe_button, self.stop_button]),
                self.status,
                self.error,
                self.topology,
                self.versions,
                self.probe_out,
            ]
        )
        self.launcher.observe(self._on_launcher, names="value")
        self.hosts.observe(self._on_hosts, names="value")
        # the nodes' interfaces belong to these hosts (or this existing cluster): refill on change
        self.profile.observe(self._on_hosts, names="value")
        self.cluster_id.observe(self._on_hosts, names="value")
        for field in (self.nodes, self.gpus_per_node, self.engines_per_node, self.partition):
            field.observe(self._on_slurm, names="value")
        for field in (self.account, self.time, self.slurm_args, self.ip, self.python):
            field.observe(self._on_slurm, names="value")
        self.check_button.on_click(self._on_check)
        self.start_button.on_click(self._on_start)
        self.probe_button.on_click(self._on_probe)
        self.stop_button.on_click(self._on_stop)
        self._on_launcher()

    # -- display -----------------------------------------------------------------------------------
    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    # -- settings ----------------------------------------------------------------------------------
    def settings(self) -> PickerSettings:
        """The settings the widgets show now."""
        port: Any = _parse_int(self.port.value)
        return PickerSettings(
            launcher=self.launcher.value,
            n=int(self.n.value),
            hosts=self.hosts.value.strip(),
            backend=self.backend.value,
            iface=self.iface.value,
            ip=self.ip.value.strip(),
            port=port,
            profile=self.profile.value.strip(),
            cluster_id=self.cluster_id.value.strip(),
            timeout=float(self.timeout.value),
            allow_version_mismatch=bool(self.allow_mismatch.value),
            python=self.python.value.strip(),
            ssh_args=self.ssh_args.value.strip(),
            nodes=int(self.nodes.value),
            gpus_per_node=_parse_int(self.gpus_per_node.value),
            engines_per_node=_parse_int(self.engines_per_node.value),
            partition=self.partition.value.strip(),
            account=self.account.value.strip(),
            time=self.time.value.strip(),
            slurm_args=self.slurm_args.value.strip(),
        )

    def _show_error(self, text: str) -> None:
        self.error.value = (
            f'<pre style="color:#842029;white-space:pre-wrap">{html.escape(text)}</pre>'
            if text
            else ""
        )

    def _on_launcher(self, *_: Any) -> None:
        which = self.launcher.value
        self._local_box.layout.display = "" if which == "local" else "none"
        self._ssh_box.layout.display = "" if which == "ssh" else "none"
        self._slurm_box.layout.display = "" if which == "slurm" else "none"
        self._engines_remote.layout.display = "" if which in ("ssh", "slurm") else "none"
        self._connect_box.layout.display = "" if which == "connect" else "none"
        self._shared_remote.layout.display = "none" if which == "local" else ""
        self._on_hosts()

    def _on_hosts(self, *_: Any) -> None:
        # validate as the user types: the message shows under the fields, nothing starts
        if self.launcher.value == "ssh" and self.hosts.value.strip():
            self._show_error(validate(self.settings()).get("hosts", ""))
        elif self.launcher.value == "slurm":
            self._on_slurm()
        else:
            self._show_error("")
        self._refresh_ifaces()

    def _on_slurm(self, *_: Any) -> None:
        # the Slurm page as the user types: a bad time limit, number or name (or no sbatch here)
        if self.launcher.value == "slurm":
            self._show_error("\n".join(validate_slurm(self.settings()).values()))

    # -- the interfaces of the nodes ---------------------------------------------------------------
    def _nodes_key_now(self) -> tuple[str, ...]:
        which = self.launcher.value
        if which == "ssh":
            return (which, self.hosts.value.strip())
        if which == "connect":
            return (which, self.profile.value.strip(), self.cluster_id.value.strip())
        if which == "slurm":
            return (which, self.partition.value.strip())
        return (which,)

    def _refresh_ifaces(self) -> None:
        """Fill the Interface dropdown for what the form shows now, keeping the choice."""
        current = self.iface.value if self.iface.value != AUTO else self._saved_iface
        self._saved_iface = AUTO  # the saved choice counts once, at the first fill
        if self._nodes is not None and self._nodes_key == self._nodes_key_now():
            options = node_interface_options(self._nodes, current, self._nodes_hosts)
        elif self.launcher.value in ("ssh", "slurm"):
            # this machine's interfaces say nothing about the hosts': ask them (Check hosts), or,
            # for Slurm nodes (not known until the job runs), take them from preflight after a start
            options = [(AUTO, AUTO)] + ([(current, current)] if current != AUTO else [])
            self.iface_info.value = (
                "<small>Check hosts lists the interfaces of the hosts; auto uses the one that "
                "routes to rank 0.</small>"
                if self.launcher.value == "ssh"
                else "<small>The nodes' interfaces are listed here after a start (preflight); "
                "auto uses the one that routes to rank 0.</small>"
            )
        else:
            names = interface_choices()
            options = [(n, n) for n in names]
            if current not in names:
                options.append((current, current))  # a saved interface of the nodes
            self.iface_info.value = ""
        self.iface.options = options
        self.iface.value = current if current in [v for _, v in options] else AUTO

    def _set_nodes(
        self, nodes: NodeInterfaces, key: tuple[str, ...], source: str, n_hosts: int
    ) -> None:
        self._nodes, self._nodes_key, self._nodes_hosts = nodes, key, n_hosts
        self._refresh_ifaces()
        if key == self._nodes_key_now():
            self.iface_info.value = node_interfaces_html(nodes, source, n_hosts)

    def node_interfaces(self) -> NodeInterfaces | None:
        """Host -> interface -> addresses, from Check hosts or the last start; None if not known."""
        return self._nodes

    def _on_check(self, _: Any = None) -> None:
        s = self.settings()
        if s.launcher != "ssh":
            return
        problem = validate(s).get("hosts")
        if problem:
            self._show_error(problem)
            return
        key = self._nodes_key_now()
        self.check_button.disabled = True
        self.start_button.disabled = True
        self._show_error("")
        self.status.value = "checking the hosts..."
        t0 = time.monotonic()

        def work() -> None:
            try:
                nodes, errors = check_node_interfaces(s, timeout=min(30.0, s.timeout))
            except Exception as e:  # the settings themselves (validated above; belt and braces)
                nodes, errors = {}, {"hosts": error_text(e)}
            try:
                if nodes:
                    self._set_nodes(nodes, key, "Check hosts", len(nodes) + len(errors))
                self._show_error("\n".join(errors.values()))
                self.status.value = html.escape(
                    f"checked {len(nodes)} of {len(nodes) + len(errors)} host(s) in "
                    f"{time.monotonic() - t0:.1f} s"
                )
            finally:
                self.check_button.disabled = False
                self.start_button.disabled = False

        self._run(work)

    # -- buttons -----------------------------------------------------------------------------------
    def _run(self, work: Any) -> None:
        if self.background:
            self._worker = threading.Thread(target=work, name="nbtrain-picker", daemon=True)
            self._worker.start()
        else:
            work()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the running start or probe has finished (for scripts and tests)."""
        if self._worker is not None:
            self._worker.join(timeout)

    def _on_start(self, _: Any = None) -> None:
        s = self.settings()
        errors = validate(s)
        if errors:
            self._show_error("\n".join(errors.values()))
            return
        self._show_error("")
        if self.remember:
            try:
                save_settings(s)
            except OSError as e:
                log.warning("nbtrain: could not save picker settings: %s", e)
        self.start_button.disabled = True
        self.check_button.disabled = True
        self.probe_button.disabled = True
        self.stop_button.disabled = True
        self.topology.value = self.versions.value = self.probe_out.value = ""
        what = "connecting" if s.launcher == "connect" else "starting"
        key = self._nodes_key_now()
        t0 = time.monotonic()
        done = threading.Event()

        progress = _Progress()

        def tick() -> None:
            while not done.wait(1.0):
                step = f": {progress.last}" if progress.last else ""
                self.status.value = html.escape(f"{what}... {time.monotonic() - t0:.0f} s{step}")

        def work() -> None:
            ticker = threading.Thread(target=tick, daemon=True)
            ticker.start()
            try:
                with progress.from_this_thread():
                    # force: the picker replaces the cluster it started (the button says Start)
                    cluster = start_cluster(s, force=self.cluster is not None)
            except Exception as e:
                done.set()
                self.status.value = f"failed after {time.monotonic() - t0:.1f} s"
                self._show_error(error_text(e))
                self.start_button.disabled = self.check_button.disabled = False
                self.stop_button.disabled = self.cluster is None or self.cluster.stopped
                self.probe_button.disabled = self.stop_button.disabled
                return
            done.set()
            self.cluster = cluster
            self.status.value = html.escape(
                f"ready: {cluster.world_size} rank(s) on {len(cluster.hosts)} host(s), backend "
                f"{cluster.backend}, in {time.monotonic() - t0:.1f} s"
            )
            self.topology.value = topology_html(cluster)
            self.versions.value = versions_html(cluster)
            # preflight saw every node's interfaces: the dropdown offers those from now on
            reports = getattr(cluster, "preflight_reports", None)
            if reports:
                nodes = interfaces_from_reports(cluster.ranks, reports)
                self._set_nodes(nodes, key, "preflight of the running cluster", len(nodes))
            self.start_button.disabled = self.check_button.disabled = False
            self.probe_button.disabled = False
            self.stop_button.disabled = False

        self.status.value = f"{what}... 0 s"
        self._run(work)

    def _on_probe(self, _: Any = None) -> None:
        cluster = self.cluster
        if cluster is None or cluster.stopped:
            self._show_error("no cluster is running; press Start first.")
            return
        self.probe_button.disabled = True
        self.probe_out.value = "probing..."

        def work() -> None:
            try:
                result = cluster.probe(max_bytes=self.probe_max_bytes)
                self.probe_out.value = f"<pre>{html.escape(str(result))}</pre>"
                self._show_error("")
            except Exception as e:
                self.probe_out.value = ""
                self._show_error(error_text(e))
            finally:
                self.probe_button.disabled = False

        self._run(work)

    def _on_stop(self, _: Any = None) -> None:
        self.wait()
        cluster = self.cluster
        if cluster is None:
            return
        try:
            cluster.stop()
        except Exception as e:
            self._show_error(error_text(e))
            return
        self.status.value = "stopped"
        self.topology.value = self.versions.value = self.probe_out.value = ""
        self.probe_button.disabled = True
        self.stop_button.disabled = True
