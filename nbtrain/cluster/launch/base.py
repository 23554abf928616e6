"""What every multi-node launcher shares: the `EngineLaunch` contract, the start, hello and stop.

In [1]: cluster = nbtrain.start(launcher="ssh", hosts="node1:2,node2:2")   # %nbtrain start --launcher ssh ...
nbtrain: controller listens on 10.0.0.5 (eth0; routes to node1, node2)

The controller runs here, on the address that routes to the hosts; engines start through
ipyparallel's own engine launchers (SSH, Slurm, MPI), one `EngineLaunch` per launcher. The rest is
shared: before the process group forms, every engine reports its versions (preflight) and the client
picks, per node, the interface that reaches rank 0, sets NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME to it
and MASTER_ADDR to rank 0's address on it (`network`).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from nbtrain import net, procs
from nbtrain.cluster import registry
from nbtrain.cluster.failures import start_failed
from nbtrain.cluster.group import init_group
from nbtrain.cluster.launch import LaunchOptions
from nbtrain.cluster.launch.network import plan_network, rendezvous_port
from nbtrain.cluster.launch.preflight import run_preflight
from nbtrain.cluster.options import HEARTBEAT_MS, Option, StartOptions
from nbtrain.cluster.ranks.topology import RankInfo, assign_ranks
from nbtrain.cluster.session import Launched, Session, close_client
from nbtrain.engine import network, setup
from nbtrain.errors import ClusterError

log = logging.getLogger(__name__)

# the options every multi-node launcher takes (each lists them in its OPTIONS); their picker fields
# are the form's shared ones (display.picker.shared), so they have no label here
NETWORK = (
    Option(
        "ip",
        "controller listen address (default: the one routing to the hosts or nodes)",
        kind="ip",
        default_doc="the address routing to the hosts or nodes",
    ),
    Option(
        "iface",
        "network interface for NCCL/gloo on every node (default: the one reaching rank 0)",
        default_doc="the interface reaching rank 0",
    ),
    Option(
        "port",
        "rendezvous port on rank 0's host (default: a free one)",
        kind="port",
        default_doc="a free port",
    ),
    Option(
        "allow_version_mismatch",
        "start although torch, NCCL, nbtrain or Python differ across nodes",
        kind="switch",
        default=False,
    ),
)
#: the Python the remote engines run (not for Ray: its workers run the Ray cluster's Python)
PYTHON = Option(
    "remote_python",
    "the Python with nbtrain on every node (default: this kernel's interpreter path)",
    flag="--python",
    metavar="PYTHON",
    default=sys.executable,
    default_doc="this kernel's interpreter path",
)


def ssh_base(lo: LaunchOptions, timeout: float) -> list[str]:
    """The ssh command and its options (no host): never prompts, gives up after `timeout`."""
    # BatchMode: never prompt for a password inside a kernel; ConnectTimeout: an unreachable host
    # fails within --timeout instead of the TCP default of minutes
    connect = max(1, int(timeout))
    return [
        "ssh",
        "-o",
        "BatchMode=yes",
        "-o",
        f"ConnectTimeout={connect}",
        *lo.ssh_args,
    ]


def ssh_run(lo: LaunchOptions, location: str, cmd: str, timeout: float) -> Any:
    """Run `cmd` on `location` over ssh (`ssh_base`'s options), capturing its output as text.

    Returns the CompletedProcess; raises subprocess.TimeoutExpired a little after `timeout`.
    """
    log.debug("ssh %s: %s", location, cmd)
    return subprocess.run(
        [*ssh_base(lo, timeout), location, cmd],
        capture_output=True,
        text=True,
        timeout=timeout + 2,
        stdin=subprocess.DEVNULL,
        check=False,
    )


class EngineLaunch:
    """One launcher's part of a multi-node start: where the controller listens, the checks before
    anything starts, ipyparallel's engine set launcher and its settings, watching the engines come
    up, and stopping them. Hello, preflight, network plan, rendezvous and group are shared.
    """

    what = "engines"  # "over SSH", "as Slurm job", ... for messages

    def __init__(self, lo: LaunchOptions) -> None:
        self.lo = lo
        self.total = 0

    def listen(self) -> net.ListenChoice:
        """The controller's listen address: one every engine can reach (never loopback for a
        remote host)."""
        raise NotImplementedError

    def prepare(self, options: StartOptions, remaining: Callable[[], float], say: Any) -> int:
        """Checks that can fail before anything starts; returns the number of engines."""
        raise NotImplementedError

    def launcher_class(self) -> Any:
        """ipyparallel's engine set launcher (a class, or its entry point name)."""
        raise NotImplementedError

    def configure(self, ipp_cluster: Any, options: StartOptions) -> None:
        """Settings of the engine set launcher, in the ipyparallel cluster's config."""

    def watch(self, ipp_cluster: Any, say: Any, force: bool = False) -> None:
        """Called about every second while engines register: raise when they never will."""

    def registered(self, ipp_cluster: Any, say: Any) -> None:
        """Every engine registered: a last word on where they run (a Slurm job that started between
        two of `watch`'s polls says so here)."""

    def raise_missing(
        self, client: Any, ipp_cluster: Any, listen: net.ListenChoice, timeout: float
    ) -> None:
        """--timeout passed before every engine registered: say what is missing, and why."""
        msg = (
            f"not every engine registered within --timeout {timeout:g} s ({len(client.ids)} of "
            f"{self.total}). Engines could not reach the controller at {listen.address}: pass --ip "
            "with an address they reach, or give a longer --timeout. Nothing was left running."
        )
        raise ClusterError(msg)

    def host_order(self) -> list[str]:
        """Launch labels (NBTRAIN_LAUNCH_HOST) in rank order; empty: order by the launcher's task ids."""
        return []

    def teardown(
        self, ipp_cluster: Any, client: Any, engine_pids: dict[str, list[int]], remove_logs: bool
    ) -> None:
        """Stop every engine and the controller; nothing is left running."""
        raise NotImplementedError

    def stop(self, session: Session) -> None:
        """The session's stop: end its engines everywhere, remove their logs."""
        self.teardown(session.ipp_cluster, session.client, session.engine_pids, True)

    def _engine_set(self, ipp_cluster: Any) -> Any:
        """ipyparallel's engine set this start launched (one per start), or None before it has."""
        for es in getattr(ipp_cluster, "engines", {}).values():
            return es
        return None

    def restart_hint(self) -> str:
        return f"%nbtrain start --force --launcher {self.lo.launcher} with the same settings"


def start_engines(launch: EngineLaunch, options: StartOptions, quiet: bool = True) -> Launched:
    """Start a controller here and engines with `launch` (ssh, slurm, mpi); form the group."""
    lo = launch.lo
    import ipyparallel as ipp

    deadline = time.monotonic() + options.timeout

    def remaining() -> float:
        return max(0.1, deadline - time.monotonic())

    def say(text: str) -> None:
        notes.append(text)
        log.info("nbtrain: %s", text)
        if not quiet:
            print(f"nbtrain: {text}", flush=True)

    notes: list[str] = []
    # where the controller listens: before anything starts, so a bad host name fails at once
    listen = launch.listen()
    say(
        f"controller listens on {listen.address} ({listen.interface or 'unknown interface'}; "
        f"{listen.reason})"
    )
    total = launch.prepare(options, remaining, say)
    options.n = total

    cluster_id = f"nbtrain-{uuid.uuid4().hex[:8]}"
    ipp_cluster = ipp.Cluster(
        n=total,
        profile=options.profile,
        cluster_id=cluster_id,
        controller_ip=listen.address,
        controller_args=[f"--HeartMonitor.period={HEARTBEAT_MS}"],
        engine_launcher_class=launch.launcher_class(),
        log_level=logging.ERROR,
        shutdown_atexit=True,
    )
    launch.configure(ipp_cluster, options)

    client = None
    engine_pids: dict[str, list[int]] = {}
    step = "starting the controller"
    try:
        log.info("cluster %s: starting the controller on %s", cluster_id, listen.address)
        ipp_cluster.start_controller_sync()
        step = f"starting {total} engine(s) {launch.what}"
        log.info("cluster %s: %s (%s launcher)", cluster_id, step, lo.launcher)
        ipp_cluster.start_engines_sync(total)
        step = "connecting to the controller"
        client = ipp_cluster.connect_client_sync()
        step = f"waiting for {total} engine(s) to register"
        while True:
            try:
                client.wait_for_engines(total, timeout=min(1.0, remaining()), interactive=False)
                break
            except TimeoutError:
                if time.monotonic() >= deadline:
                    launch.raise_missing(client, ipp_cluster, listen, options.timeout)
                    raise
                launch.watch(ipp_cluster, say)
            except Exception:
                # ipyparallel noticed the engine set end ("Engine set stopped"): the launcher's
                # own account of why (mpiexec's message, the job's output) is the one to show
                launch.watch(ipp_cluster, say, force=True)
                raise
        launch.registered(ipp_cluster, say)
        step = "saying hello to the engines"
        ranks, engine_pids = hello(client, launch.host_order(), remaining)
        log.info(
            "cluster %s: %d engine(s) registered, pids by host %s", cluster_id, total, engine_pids
        )
        step = "running preflight on every engine"
        result = run_preflight(client, ranks, lo.allow_version_mismatch, remaining, say)
        step = "choosing the network interface of every node"
        master_addr = plan_network(
            client, ranks, result.reports_by_rank, lo.iface, listen, remaining
        )
        step = "choosing the rendezvous port"
        port = rendezvous_port(client, ranks, lo.port, remaining)
        say(
            f"rendezvous at {master_addr}:{port} (rank 0 on {ranks[0].host}, interface "
            f"{ranks[0].interface})"
        )
        step = "joining the process group"
        plan = init_group(
            client,
            ranks,
            options,
            remaining,
            master_addr=master_addr,
            port=port,
            launcher=lo.launcher,
            run_id=ipp_cluster.cluster_id,
        )
    except BaseException as e:
        log.info("cluster %s: start failed while %s (%s); tearing down", cluster_id, step, e)
        launch.teardown(ipp_cluster, client, engine_pids, False)
        error = start_failed(step, e)
        if error is e:
            raise
        raise error from e
    return Launched(
        client,
        ipp_cluster,
        ranks,
        plan,
        options,
        launcher=lo.launcher,
        stop=launch.stop,
        restart_hint=launch.restart_hint(),
        notes=notes,
        listen=listen,
        preflight=result.result,
        preflight_reports=result.reports_by_rank,
        engine_pids=engine_pids,
        on_ready=registry.write,
    )


def hello(
    client: Any, host_order: Sequence[str], remaining: Callable[[], float]
) -> tuple[list[RankInfo], dict[str, list[int]]]:
    """Node-major ranks, and each launch label's engine pids (engine and its nanny).

    Hosts follow `host_order` (the --hosts entries) where given; otherwise, as for Slurm and MPI,
    the order of the launcher's task ids (SLURM_PROCID, the MPI rank): a host's place is that of
    its lowest task, and engines on a host follow their tasks. The ranks are nbtrain's own,
    contiguous per host, whatever order the launcher numbered its tasks in.
    """
    dv = client[:]
    ar_hello = dv.apply_async(setup.hello)
    ar_slot = dv.apply_async(network.launch_slot)
    hellos = {eid: h for eid, h in zip(dv.targets, ar_hello.get(timeout=remaining()))}
    slots = {eid: s for eid, s in zip(dv.targets, ar_slot.get(timeout=remaining()))}
    labels = {eid: s.get("label") for eid, s in slots.items()}
    # the host name is what the node calls itself
    order: list[str] = []
    engine_order: dict[int, Any] | None = None
    if host_order:
        for label in host_order:
            for eid in sorted(hellos):
                if labels.get(eid) == label and hellos[eid]["host"] not in order:
                    order.append(hellos[eid]["host"])
    else:
        inf = float("inf")
        engine_order = {
            eid: (slots[eid].get("task") if slots[eid].get("task") is not None else inf, eid)
            for eid in hellos
        }
        for eid in sorted(hellos, key=lambda e: engine_order[e] if engine_order else e):
            if hellos[eid]["host"] not in order:
                order.append(hellos[eid]["host"])
    pids: dict[str, list[int]] = {}
    for eid, h in hellos.items():
        pids.setdefault(labels.get(eid) or h["host"], []).extend(
            [int(h["pid"]), *h.get("children", [])]
        )
    return assign_ranks(hellos, order, engine_order), pids


def leave(client: Any, ranks: Sequence[RankInfo]) -> None:
    """Leave engines someone else started: end their process group, close the client."""
    try:
        ids = [r.engine_id for r in ranks]
        client.direct_view(targets=ids).apply_async(setup.shutdown_group).get(timeout=10)
    except Exception as e:
        log.debug("leaving the process group failed: %s", e)
    close_client(client)


def stop_here(ipp_cluster: Any, local: Sequence[int]) -> bool:
    """ipyparallel's own stop (engines' launcher, then the controller), then whatever is left of
    `local` here: their children, and the process groups they lead (the controller's schedulers).
    False if ipyparallel's stop failed (the caller may have its own way to end the engines)."""
    groups = procs.session_groups(local)
    stopped = True
    if ipp_cluster is not None:
        try:
            ipp_cluster.stop_cluster_sync()
        except Exception as e:
            log.debug("ipyparallel stop_cluster failed: %s", e)
            stopped = False
        registry.forget(ipp_cluster)
    procs.kill_tree(local)
    procs.kill_groups(groups)
    return stopped


def teardown_remote(
    ipp_cluster: Any,
    client: Any,
    lo: LaunchOptions,
    engine_pids: dict[str, list[int]],
    remove_logs: bool = False,
) -> None:
    """Stop engines on their hosts, make sure none survives, then stop the controller here.

    Remote pids are only ever signalled on their own host (here they may be anyone's). The engines'
    logs on the hosts are kept after a failed start (the error message points at them).
    """
    log.info("stopping engines %s and the controller", engine_pids or "(none registered)")
    close_client(client)
    location_of = {s.host: s.location for s in lo.hosts}
    pids: dict[str, set[int]] = {}
    files: dict[str, set[str]] = {}
    for host, hp in engine_pids.items():
        pids.setdefault(location_of.get(host, host), set()).update(hp)
    engine_sets = list(getattr(ipp_cluster, "engines", {}).values())
    for engine_set in engine_sets:
        for el in getattr(engine_set, "launchers", {}).values():
            # every engine ipyparallel started, registered or not
            if getattr(el, "pid", None) and getattr(el, "location", None):
                pids.setdefault(el.location, set()).add(int(el.pid))
                if remove_logs and el.remote_output_file:
                    files.setdefault(el.location, set()).add(el.remote_output_file)
    procs.kill_on_hosts(ssh_base(lo, 10), lo.remote_python, pids, files)
    for engine_set in engine_sets:
        engine_set._nbtrain_killed = True
    stop_here(ipp_cluster, procs.controller_pids(ipp_cluster))
