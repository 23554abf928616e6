"""Connecting to an ipyparallel cluster started any way (ipcluster, a job script): `nbtrain.connect`.

In [1]: cluster = nbtrain.connect(profile="mpi")      # twin of %nbtrain connect --profile mpi

Its engines get ranks, preflight, a network plan and a process group as a started cluster's do;
stopping it leaves the engines running (whoever started them stops them).
"""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
import time
from typing import Any

from nbtrain import net
from nbtrain.cluster.group import init_group
from nbtrain.cluster.launch.base import leave
from nbtrain.cluster.launch.network import plan_network, rendezvous_port
from nbtrain.cluster.launch.preflight import run_preflight
from nbtrain.cluster.options import StartOptions
from nbtrain.cluster.ranks.topology import assign_ranks
from nbtrain.cluster.session import Launched, Session
from nbtrain.engine import setup
from nbtrain.errors import ClusterError, ConfigError

log = logging.getLogger(__name__)


def find_ipp_cluster(cluster_id: str | None, profile: str | None, file: str | None) -> Any:
    """The running ipyparallel cluster named by id, profile or file; exactly one, else an error."""
    import ipyparallel as ipp
    from ipyparallel.cluster.cluster import ClusterManager

    if file:
        try:
            return ipp.Cluster.from_file(file)
        except FileNotFoundError:
            msg = f"no cluster file {file}; ipyparallel writes it to <profile>/security/cluster-<id>.json."
            raise ConfigError(msg) from None
    manager = ClusterManager()
    try:
        found = manager.load_clusters(profile=profile) if profile else manager.load_clusters()
    except Exception as e:  # IPython's ProfileDirError for an unknown profile
        msg = f"cannot read profile {profile!r}: {e}. Name an existing profile or pass --file."
        raise ClusterError(msg) from None
    running = {k: c for k, c in found.items() if c.controller is not None}
    if cluster_id is not None:
        running = {k: c for k, c in running.items() if c.cluster_id == cluster_id}
    if len(running) == 1:
        return next(iter(running.values()))
    where = f"profile {profile}" if profile else "any IPython profile"
    if not running:
        what = f"cluster {cluster_id!r}" if cluster_id else "running ipyparallel cluster"
        msg = (
            f"no {what} in {where}. Start one (ipcluster start -n 2 --profile P) and connect with "
            "%nbtrain connect --profile P, or pass --file with its cluster file."
        )
        raise ClusterError(msg)
    listed = ", ".join(sorted(running))
    msg = (
        f"several clusters in {where}: {listed}. Name one: %nbtrain connect CLUSTER_ID --profile P."
    )
    raise ClusterError(msg)


def connect(
    cluster_id: str | None,
    options: StartOptions,
    *,
    profile: str | None = None,
    file: str | None = None,
    iface: str | None = None,
    port: int | None = None,
    allow_version_mismatch: bool = False,
    quiet: bool = True,
) -> Launched:
    """The connect launcher: rank the engines of a running ipyparallel cluster and join their group.

    `nbtrain.connect` (the public twin of %nbtrain connect) checks the options and calls this.
    """
    timeout = options.timeout
    deadline = time.monotonic() + timeout

    def remaining() -> float:
        return max(0.1, deadline - time.monotonic())

    ipp_cluster = find_ipp_cluster(cluster_id, profile, file)
    client = ipp_cluster.connect_client_sync()
    try:
        # a cluster that is still starting: wait for the engines its launchers started
        expected = sum(int(getattr(es, "n", 0) or 0) for es in ipp_cluster.engines.values())
        try:
            client.wait_for_engines(max(1, expected), timeout=remaining(), interactive=False)
        except TimeoutError:
            pass
        ids = sorted(client.ids)
        if not ids:
            msg = f"cluster {ipp_cluster.cluster_id!r} has no engines registered; start some first."
            raise ClusterError(msg)
        dv = client.direct_view(targets=ids)
        hellos = dict(zip(ids, dv.apply_async(setup.hello).get(timeout=remaining())))
        ranks = assign_ranks(hellos)
        options.n = len(ranks)
        notes: list[str] = []
        result = run_preflight(client, ranks, allow_version_mismatch, remaining, notes.append)
        # the controller's address as this client reaches it; where that is loopback but engines
        # run elsewhere, this machine's address on the route to their hosts
        m = re.search(r"//\[?([^\]/]+?)\]?$", str(client._config.get("interface", "")))
        ctl = m.group(1) if m and m.group(1) not in ("*", "0.0.0.0") else net.LOOPBACK
        local_only = all(r.host == socket.gethostname() for r in ranks)
        if ipaddress.ip_address(ctl).is_loopback and not local_only:
            listen = net.listen_address([r.host for r in ranks])
        else:
            listen = net.ListenChoice(ctl, net.interface_of(ctl), "the connected controller")
        master_addr = plan_network(client, ranks, result.reports_by_rank, iface, listen, remaining)
        port_ = rendezvous_port(client, ranks, port, remaining)
        plan = init_group(
            client,
            ranks,
            options,
            remaining,
            master_addr=master_addr,
            port=port_,
            launcher="connect",
            run_id=ipp_cluster.cluster_id,
        )
    except BaseException:
        leave(client, [])
        raise
    if not quiet:
        for n in notes:
            print(f"nbtrain: {n}")
    return Launched(
        client,
        None,
        ranks,
        plan,
        options,
        launcher="connect",
        stop=_leave_session,
        restart_hint="restart it where it was started, then %nbtrain connect again",
        notes=notes,
        preflight=result.result,
        preflight_reports=result.reports_by_rank,
    )


def _leave_session(session: Session) -> None:
    # connected, not started: leave the engines to whoever started them
    leave(session.client, session.ranks)
