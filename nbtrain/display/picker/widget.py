"""`nbtrain.ClusterPicker()`: start, inspect, probe and stop a cluster from a widget.

In [1]: nbtrain.ClusterPicker()

The form is its pages (`local`, `ssh`, `slurm`, `ray`, `existing`, and the fields they share in `shared`)
over the results view (`results`); this module assembles them and handles the buttons. The widget is
thin: the settings, their validation and the call into the Python API are `settings`' plain
functions, the same `nbtrain.start` / `nbtrain.connect` the magics call.
"""

from __future__ import annotations

import html
import logging
import threading
import time
from typing import Any, Protocol

from nbtrain.display.picker.existing import ExistingPage
from nbtrain.display.picker.fields import OptionsPage
from nbtrain.display.picker.interfaces import (
    NodeInterfaces,
    check_node_interfaces,
    interface_choices,
    interfaces_from_reports,
    node_interface_options,
    node_interfaces_html,
)
from nbtrain.display.picker.local import LocalPage
from nbtrain.display.picker.ray import RayPage
from nbtrain.display.picker.results import Progress, ResultsView, error_text
from nbtrain.display.picker.settings import (
    AUTO,
    BACKENDS,
    PAGES,
    PickerSettings,
    launchers,
    load_settings,
    save_settings,
    start_cluster,
    validate,
    validate_slurm,
)
from nbtrain.display.picker.shared import NodeNetwork, RemoteEngines
from nbtrain.display.picker.slurm import SlurmPage
from nbtrain.display.picker.ssh import SshPage

log = logging.getLogger(__name__)


class Page(Protocol):
    """A launcher's page: its box of fields, their settings, what the nodes' interfaces belong to."""

    box: Any

    def values(self) -> dict[str, Any]: ...

    def nodes_key(self) -> tuple[str, ...]: ...


# a field's width, its label included: ipywidgets' default (300 px, less the 150 px label) cut
# placeholders and sbatch lines to 148 px
FIELD_WIDTH = "560px"


def fit_fields(box: Any) -> None:
    """Give every text field, number box and dropdown under `box` the room its text needs (up to
    the output's width); toggles, checkboxes and buttons keep their own size."""
    import ipywidgets as w

    fields = (w.Text, w.Textarea, w.IntText, w.BoundedIntText, w.BoundedFloatText, w.Dropdown)
    for child in getattr(box, "children", ()):
        if isinstance(child, fields):
            child.layout.width = "100%"
            child.layout.max_width = FIELD_WIDTH
        else:
            fit_fields(child)


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

        shown = launchers()
        self.launcher = w.ToggleButtons(
            options=[(label, k) for k, label in shown.items()],
            value=s.launcher if s.launcher in shown else "local",
            description="Launcher",
            style=style,
        )
        self.local_page = LocalPage(s, style)
        self.ssh_page = SshPage(s, style)
        self.slurm_page = SlurmPage(s, style)
        self.ray_page = RayPage(s, style)
        self.existing_page = ExistingPage(s, style)
        self.pages: dict[str, Page] = {
            "local": self.local_page,
            "ssh": self.ssh_page,
            "slurm": self.slurm_page,
            "ray": self.ray_page,
            "connect": self.existing_page,
        }
        # a launcher with no page of its own: its page is made from the options it declares
        for name in shown:
            if name not in PAGES:
                self.pages[name] = OptionsPage(name, s, style)
        self.remote = RemoteEngines(s, style)
        self.network = NodeNetwork(s, style)
        self.backend = w.Dropdown(
            options=list(BACKENDS),
            value=s.backend if s.backend in BACKENDS else "auto",
            description="Backend",
            style=style,
        )
        self.timeout = w.BoundedFloatText(
            value=s.timeout, min=1, max=3600, description="Timeout (s)", style=style
        )
        self.start_button = w.Button(description="Start", button_style="primary", icon="play")
        self.probe_button = w.Button(description="Probe", icon="tachometer", disabled=True)
        self.stop_button = w.Button(
            description="Stop", button_style="danger", icon="stop", disabled=True
        )
        self.results = ResultsView()

        # every field stays an attribute of the picker (scripts and tests set them by name)
        self.n = self.local_page.n
        self.hosts = self.ssh_page.hosts
        self.ssh_args = self.ssh_page.ssh_args
        self.check_button = self.ssh_page.check_button
        self.nodes = self.slurm_page.nodes
        self.gpus_per_node = self.slurm_page.gpus_per_node
        self.engines_per_node = self.slurm_page.engines_per_node
        self.partition = self.slurm_page.partition
        self.account = self.slurm_page.account
        self.time = self.slurm_page.time
        self.slurm_args = self.slurm_page.slurm_args
        self.address = self.ray_page.address
        self.placement = self.ray_page.placement
        self.gpus_per_rank = self.ray_page.gpus_per_rank
        self.cpus_per_rank = self.ray_page.cpus_per_rank
        self.profile = self.existing_page.profile
        self.cluster_id = self.existing_page.cluster_id
        self.ip = self.remote.ip
        self.python = self.remote.python
        self.iface = self.network.iface
        self.iface_info = self.network.iface_info
        self.port = self.network.port
        self.allow_mismatch = self.network.allow_mismatch
        self.status = self.results.status
        self.error = self.results.error
        self.topology = self.results.topology
        self.versions = self.results.versions
        self.probe_out = self.results.probe_out
        self._local_box = self.local_page.box
        self._ssh_box = self.ssh_page.box
        self._slurm_box = self.slurm_page.box
        self._ray_box = self.ray_page.box
        self._connect_box = self.existing_page.box
        self._engines_remote = self.remote.box
        self._shared_remote = self.network.box

        # the Interface dropdown is filled by _refresh_ifaces: the nodes' interfaces once known
        self._saved_iface = s.iface or AUTO
        # the nodes' interfaces and what they belong to: (launcher, hosts or profile/cluster id)
        self._nodes: NodeInterfaces | None = None
        self._nodes_key: tuple[str, ...] | None = None
        self._nodes_hosts = 0  # hosts asked (some may not have answered)

        self.widget = w.VBox(
            [
                self.launcher,
                self._local_box,
                self._ssh_box,
                self._slurm_box,
                self._ray_box,
                *[page.box for name, page in self.pages.items() if name not in PAGES],
                self._engines_remote,
                self._connect_box,
                self.backend,
                self._shared_remote,
                self.timeout,
                w.HBox([self.start_button, self.probe_button, self.stop_button]),
                *self.results.children(),
            ]
        )
        fit_fields(self.widget)
        self.launcher.observe(self._on_launcher, names="value")
        self.hosts.observe(self._on_hosts, names="value")
        # the nodes' interfaces belong to these hosts (or this existing cluster): refill on change
        self.profile.observe(self._on_hosts, names="value")
        self.cluster_id.observe(self._on_hosts, names="value")
        for field in (*self.slurm_page.fields(), self.ip, self.python):
            field.observe(self._on_slurm, names="value")
        for field in (*self.ray_page.fields(), self.ip, self.port):
            field.observe(self._on_ray, names="value")
        for page in self.pages.values():
            if isinstance(page, OptionsPage):
                for field in page.fields():
                    field.observe(self._on_page, names="value")
        self.check_button.on_click(self._on_check)
        self.start_button.on_click(self._on_start)
        self.probe_button.on_click(self._on_probe)
        self.stop_button.on_click(self._on_stop)
        self._on_launcher()
        self._show_running()

    # -- display -----------------------------------------------------------------------------------
    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        self._show_running()
        return self.widget._repr_mimebundle_(**kwargs)

    def _show_running(self) -> None:
        """Show the cluster that `%%distributed` cells run on, when this picker did not start it:
        its launcher, size and tables, Probe and Stop; Start waits until it is stopped (a start
        would refuse to replace it)."""
        from nbtrain.cluster.facade import current_cluster

        cluster = current_cluster()
        if cluster is None or cluster is self.cluster:
            return
        self.cluster = cluster
        if cluster.launcher in self.pages:
            self.launcher.value = cluster.launcher
        if cluster.launcher == "local":
            self.n.value = cluster.world_size
        if cluster.backend in BACKENDS:
            self.backend.value = cluster.backend
        self.status.value = html.escape(
            f"running: {cluster.world_size} rank(s) on {len(cluster.hosts)} host(s), backend "
            f"{cluster.backend}, started before this picker; Stop it to start another here"
        )
        self.results.show_cluster(cluster)
        self.start_button.disabled = True
        self.probe_button.disabled = self.stop_button.disabled = False

    # -- settings ----------------------------------------------------------------------------------
    def settings(self) -> PickerSettings:
        """The settings the widgets show now."""
        values: dict[str, Any] = {}
        options: dict[str, dict[str, Any]] = {}
        parts: list[Any] = [*self.pages.values(), self.remote, self.network]
        for part in parts:
            got = dict(part.values())
            for launcher, more in got.pop("options", {}).items():
                options.setdefault(launcher, {}).update(more)
            values.update(got)
        return PickerSettings(
            launcher=self.launcher.value,
            backend=self.backend.value,
            timeout=float(self.timeout.value),
            options=options,
            **values,
        )

    def _show_error(self, text: str) -> None:
        self.results.show_error(text)

    def _on_launcher(self, *_: Any) -> None:
        which = self.launcher.value
        for name, page in self.pages.items():
            page.box.layout.display = "" if which == name else "none"
        self._engines_remote.layout.display = "" if which in ("ssh", "slurm", "ray") else "none"
        # Ray actors run the Python of the Ray cluster's workers: --python is not theirs to give
        self.python.layout.display = "none" if which == "ray" else ""
        self._shared_remote.layout.display = "none" if which == "local" else ""
        self._on_hosts()

    def _on_hosts(self, *_: Any) -> None:
        # validate as the user types: the message shows under the fields, nothing starts
        if self.launcher.value == "ssh" and self.hosts.value.strip():
            self._show_error(validate(self.settings()).get("hosts", ""))
        elif self.launcher.value == "slurm":
            self._on_slurm()
        elif self.launcher.value == "ray":
            self._on_ray()
        elif self.launcher.value not in PAGES:
            self._on_page()
        else:
            self._show_error("")
        self._refresh_ifaces()

    def _on_slurm(self, *_: Any) -> None:
        # the Slurm page as the user types: a bad time limit, number or name (or no sbatch here)
        if self.launcher.value == "slurm":
            self._show_error("\n".join(validate_slurm(self.settings()).values()))

    def _on_ray(self, *_: Any) -> None:
        # the Ray page as the user types: an address, placement, rank count or amount it would refuse
        if self.launcher.value == "ray":
            self._show_error("\n".join(validate(self.settings()).values()))

    def _on_page(self, *_: Any) -> None:
        # a page made from a launcher's options, as the user types: what LaunchOptions would refuse
        if self.launcher.value not in PAGES:
            self._show_error("\n".join(validate(self.settings()).values()))

    # -- the interfaces of the nodes ---------------------------------------------------------------
    def _nodes_key_now(self) -> tuple[str, ...]:
        which = self.launcher.value
        return (which, *self.pages[which].nodes_key())

    def _refresh_ifaces(self) -> None:
        """Fill the Interface dropdown for what the form shows now, keeping the choice."""
        current = self.iface.value if self.iface.value != AUTO else self._saved_iface
        self._saved_iface = AUTO  # the saved choice counts once, at the first fill
        if self._nodes is not None and self._nodes_key == self._nodes_key_now():
            options = node_interface_options(self._nodes, current, self._nodes_hosts)
        elif self.launcher.value in ("ssh", "slurm", "ray"):
            # this machine's interfaces say nothing about the hosts': ask them (Check hosts), or,
            # for Slurm and Ray nodes (not known until the engines run), from preflight after a start
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
        self.results.clear_cluster()
        what = "connecting" if s.launcher == "connect" else "starting"
        key = self._nodes_key_now()
        t0 = time.monotonic()
        done = threading.Event()

        progress = Progress()

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
            except Exception as e:  # shown in the form, which the user is looking at
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
            self.results.show_cluster(cluster)
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
            except Exception as e:  # shown in the form, which the user is looking at
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
        except Exception as e:  # shown in the form, which the user is looking at
            self._show_error(error_text(e))
            return
        self.status.value = "stopped"
        self.start_button.disabled = False
        self.results.clear_cluster()
        self.probe_button.disabled = True
        self.stop_button.disabled = True
