"""Multi-node clusters: engines over SSH, as a Slurm job or under mpiexec, or started elsewhere.

In [1]: cluster = nbtrain.start(launcher="ssh", hosts="node1:2,node2:2")   # %nbtrain start --launcher ssh ...
nbtrain: controller listens on 10.0.0.5 (eth0; routes to node1, node2)
In [2]: cluster = nbtrain.start(launcher="slurm", nodes=2, gpus_per_node=4)  # one sbatch job
In [3]: cluster = nbtrain.start(launcher="mpi", n=8)                         # one mpiexec
In [4]: cluster = nbtrain.connect(profile="default")                        # %nbtrain connect --profile default

The controller runs here, on the address that routes to the hosts; engines start through
ipyparallel's own engine launchers (SSH, Slurm, MPI), one `EngineLaunch` per launcher. The rest is
shared: before the process group forms, every engine reports its versions (preflight) and the client
picks, per node, the interface that reaches rank 0, sets NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME to it
and MASTER_ADDR to rank 0's address on it.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import re
import shlex
import socket
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any

from nbtrain.cluster import net
from nbtrain.cluster.core import (
    HEARTBEAT_MS,
    Cluster,
    RankInfo,
    StartOptions,
    _describe_ranks,
    _init_group,
    _kill_groups,
    _kill_tree,
    _session_groups,
    assign_ranks,
    close_client,
    format_table,
)
from nbtrain.errors import ClusterError, ConfigError, NbtrainError

log = logging.getLogger("nbtrain")

LAUNCHERS = ("local", "ssh", "slurm", "mpi")
LAUNCH_HOST_ENV = "NBTRAIN_LAUNCH_HOST"


# -- settings --------------------------------------------------------------------------------------

# the settings each launcher takes besides the shared ones (ip, iface, port, allow_version_mismatch,
# remote_python); giving another launcher's setting is an error, not silently ignored
_ONLY = {
    "hosts": ("ssh", "mpi"),
    "ssh_args": ("ssh",),
    "host_env": ("ssh",),
    "nodes": ("slurm",),
    "gpus_per_node": ("slurm",),
    "engines_per_node": ("slurm",),
    "partition": ("slurm",),
    "account": ("slurm",),
    "time": ("slurm",),
    "slurm_args": ("slurm",),
    "n": ("local", "mpi"),
    "mpi_args": ("mpi",),
}
_FLAG_HINT = {
    "ssh": "give the engines per host in --hosts (node1:2,node2:2)",
    "slurm": "give --nodes and --gpus-per-node (or --engines-per-node)",
    "mpi": "give the ranks with -n (and --hosts for several hosts)",
}


def _flag(name: str) -> str:
    return "-n" if name == "n" else "--" + name.replace("_", "-")


@dataclass
class LaunchOptions:
    """Settings of a multi-node start (`%nbtrain start --launcher ssh|slurm|mpi ...`), validated on entry."""

    launcher: str = "ssh"  # ssh, slurm or mpi
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

    def __post_init__(self) -> None:
        if self.launcher == "local":
            msg = (
                "hosts, ip, iface, port and the other multi-node settings need launcher='ssh', "
                "'slurm' or 'mpi' (%nbtrain start --launcher ssh --hosts ...)."
            )
            raise ConfigError(msg)
        if self.launcher not in LAUNCHERS:
            msg = f"unknown launcher {self.launcher!r}; choose one of {', '.join(LAUNCHERS)}."
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
            from nbtrain.cluster import slurm

            slurm.validate(self)
        elif self.launcher == "mpi":
            from nbtrain.cluster import mpi

            mpi.validate(self)
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


# -- ipyparallel's SSH engine launcher, started in parallel ----------------------------------------


def _ssh_engine_set_class() -> type:
    from nbtrain.cluster.ssh_engines import ParallelSSHEngineSetLauncher

    return ParallelSSHEngineSetLauncher


# -- reaching the hosts ----------------------------------------------------------------------------

_HOST_CHECK = """
import json, os, socket, sys
out = {"hostname": socket.gethostname(), "python": sys.executable}
try:
    import nbtrain
    from nbtrain.engine.setup import _cuda_count
    out["nbtrain"] = nbtrain.__version__
    out["gpus"] = _cuda_count()
    from nbtrain.engine.preflight import network_interfaces
    out["interfaces"] = {n: v["addresses"] for n, v in network_interfaces().items()}
    if len(sys.argv) > 1:
        from nbtrain.cluster.net import port_in_use
        out["port_in_use"] = port_in_use(int(sys.argv[1]))
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
print("NBTRAIN_HOST_CHECK " + json.dumps(out))
"""


@dataclass
class HostCheck:
    host: str
    hostname: str
    gpus: int
    interfaces: dict[str, list[str]] = field(default_factory=dict)
    port_in_use: bool | None = None  # for --port, asked on the first host (rank 0's) only


def _ssh_base(lo: LaunchOptions, timeout: float) -> list[str]:
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


def check_hosts(lo: LaunchOptions, timeout: float) -> dict[str, HostCheck]:
    """Log in to every host at once and ask its Python for nbtrain and the GPU count.

    This is where the errors users meet on a new cluster surface, with ssh's own message: an
    unreachable host, a refused key, a missing Python or nbtrain.
    """
    base = _ssh_base(lo, timeout)

    def one(spec: net.HostSpec) -> HostCheck:
        # the engines' environment on that host (CUDA_VISIBLE_DEVICES changes the GPU count)
        env = [f"{k}={v}" for k, v in lo.host_env.get(spec.host, {}).items()]
        prefix = "env " + " ".join(shlex.quote(e) for e in env) + " " if env else ""
        cmd = f"{prefix}{shlex.quote(lo.remote_python)} -c {shlex.quote(_HOST_CHECK)}"
        if lo.port is not None and spec is lo.hosts[0]:
            cmd += f" {int(lo.port)}"
        try:
            proc = subprocess.run(
                [*base, spec.location, cmd],
                capture_output=True,
                text=True,
                timeout=timeout + 2,
                stdin=subprocess.DEVNULL,
                check=False,
            )
        except subprocess.TimeoutExpired:
            msg = (
                f"host {spec.host} did not answer over SSH within --timeout {timeout:g} s. Check that "
                f"it is up and reachable from this machine (`ssh {spec.location} true`), or give a "
                "longer --timeout. Nothing was started."
            )
            raise ClusterError(msg) from None
        line = next(
            (ln for ln in proc.stdout.splitlines() if ln.startswith("NBTRAIN_HOST_CHECK ")), None
        )
        err = proc.stderr.strip()
        if proc.returncode == 255 or (line is None and proc.returncode != 127 and not err):
            what = err or f"ssh exited with {proc.returncode}"
            if "timed out" in what.lower():
                fix = (
                    f"Check that {spec.host} is up and reachable from this machine, or give a longer "
                    "--timeout."
                )
            elif "permission denied" in what.lower() or "publickey" in what.lower():
                fix = (
                    f"Set up key-based login (`ssh-copy-id {spec.location}`) so that "
                    f"`ssh {spec.location} true` works without a password."
                )
            else:
                fix = f"Make `ssh {spec.location} true` work from this machine first."
            msg = f"cannot log in to host {spec.host} over SSH: {what}. {fix} Nothing was started."
            raise ClusterError(msg)
        if line is None:
            msg = (
                f"no Python at {lo.remote_python} on host {spec.host} ({err or proc.returncode}). "
                "Pass --python with the path of the Python that has nbtrain installed on every "
                "host (the same path everywhere). Nothing was started."
            )
            raise ClusterError(msg)
        info = json.loads(line.split(" ", 1)[1])
        if "error" in info:
            msg = (
                f"{lo.remote_python} on host {spec.host} cannot import nbtrain ({info['error']}). "
                f"Install it there (pip install nbtrain), or pass --python with the Python that has "
                "it. Nothing was started."
            )
            raise ClusterError(msg)
        return HostCheck(
            spec.host,
            info["hostname"],
            int(info.get("gpus", 0)),
            info.get("interfaces", {}),
            info.get("port_in_use"),
        )

    specs: list[net.HostSpec] = lo.hosts
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = [pool.submit(one, s) for s in specs]
        results: dict[str, HostCheck] = {}
        first_error: Exception | None = None
        for spec, fut in zip(specs, futures):
            try:
                results[spec.host] = fut.result()
            except Exception as e:
                first_error = first_error or e
    if first_error is not None:
        raise first_error
    return results


def engine_counts(lo: LaunchOptions, checks: dict[str, HostCheck], backend: str) -> dict[str, int]:
    """Engines per host: as given, else the host's GPU count (1 without GPUs).

    `--backend nccl` where a host would have more engines than GPUs fails here, before any engine
    starts, with the device plan's own message; the plan decides again on the engines' GPU counts.
    """
    from nbtrain.cluster.plan import Slot, plan_devices

    counts = {}
    for spec in lo.hosts:
        gpus = checks[spec.host].gpus
        counts[spec.host] = spec.engines if spec.engines is not None else max(1, gpus)
    if backend == "nccl":
        slots = [
            Slot(spec.host, i, checks[spec.host].gpus)
            for spec in lo.hosts
            for i in range(counts[spec.host])
        ]
        plan_devices(slots, backend, launcher=lo.launcher)
    return counts


# -- the cluster -----------------------------------------------------------------------------------


class RemoteCluster(Cluster):
    """A cluster whose engines run on other hosts (SSH, Slurm, MPI) or were started elsewhere."""

    def __init__(
        self,
        client: Any,
        ipp_cluster: Any,
        ranks: list[RankInfo],
        backend: str,
        options: StartOptions,
        *,
        launch: LaunchOptions | None = None,
        listen: net.ListenChoice | None = None,
        preflight: Any = None,
        notes: Sequence[str] = (),
        local_pids: Sequence[int] = (),
        engine_pids: dict[str, list[int]] | None = None,
        preflight_reports: list[dict[str, Any]] | None = None,
        engine_launch: EngineLaunch | None = None,
    ) -> None:
        super().__init__(client, ipp_cluster, ranks, backend, options, pids=local_pids)
        self.engine_pids = engine_pids or {}  # --hosts entry -> pids of its engines (on that host)
        self.launch = launch
        if engine_launch is None and launch is not None:
            engine_launch = engine_launch_for(launch)
        self.engine_launch = engine_launch  # how the engines were started, and how they stop
        self.listen = listen
        self.preflight = preflight
        self.notes = list(notes)
        self.preflight_reports = preflight_reports  # collect() of every rank, in rank order

    def table(self) -> str:
        """The rank table: rank, host, local rank, device, address, interface, pid."""
        rows = [("rank", "host", "local", "device", "address", "interface", "pid")]
        for r in self.ranks:
            rows.append(
                (
                    str(r.rank),
                    r.host,
                    str(r.local_rank),
                    r.device,
                    r.address,
                    r.interface or "-",
                    str(r.pid),
                )
            )
        return format_table(rows)

    def stop(self) -> None:
        """Stop every engine (on every host) and the controller; nothing is left running."""
        from nbtrain.cluster import core

        if self._stopped:
            return
        self._stopped = True
        if core._current is self:
            core._current = None
        if self.launch is None:
            # connected, not started: leave the engines to whoever started them
            _leave(self.client, self.ranks)
            return
        assert self.engine_launch is not None
        self.engine_launch.teardown(self.ipp_cluster, self.client, self.engine_pids, True)

    def _launcher_name(self) -> str:
        return self.launch.launcher if self.launch is not None else "connect"

    def restart_ranks(self, ranks: Sequence[int], timeout: float | None = None) -> None:
        hint = (
            self.engine_launch.restart_hint()
            if self.engine_launch
            else "%nbtrain start --force with the same --hosts"
        )
        msg = (
            f"{_describe_ranks(self.ranks, list(ranks))} did not stop, and nbtrain cannot yet replace "
            f"single engines on other hosts. Restart the cluster: {hint}."
        )
        raise ClusterError(msg)


def _leave(client: Any, ranks: Sequence[RankInfo]) -> None:
    from nbtrain.engine import setup

    try:
        ids = [r.engine_id for r in ranks]
        client.direct_view(targets=ids).apply_async(setup.shutdown_group).get(timeout=10)
    except Exception as e:
        log.debug("leaving the process group failed: %s", e)
    close_client(client)


_KILL_LEFT = """
import json, os, sys, time
import psutil
pids, files = json.loads(sys.argv[1]), json.loads(sys.argv[2])
procs = []
for pid in pids:
    try:
        p = psutil.Process(pid)
        procs += [p] + p.children(recursive=True)
    except psutil.Error:
        pass

def alive(p):
    # a zombie has exited; only its parent (or init) has yet to reap it
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False

def signal_all(procs, kill):
    for p in procs:
        try:
            p.kill() if kill else p.terminate()
        except psutil.Error:
            pass

def wait(procs, timeout):
    deadline = time.monotonic() + timeout
    while True:
        procs = [p for p in procs if alive(p)]
        if not procs or time.monotonic() > deadline:
            return procs
        time.sleep(0.05)

# engines hold nothing to save; TERM lets them close sockets, KILL whoever is slow
signal_all(procs, kill=False)
left = wait(procs, 1)
signal_all(left, kill=True)
left = wait(left, 3)
for f in files:
    try:
        os.remove(os.path.expanduser(f))
    except OSError:
        pass
print("NBTRAIN_LEFT " + json.dumps([p.pid for p in left]))
"""


def _kill_on_hosts(
    lo: LaunchOptions, pids: dict[str, set[int]], files: dict[str, set[str]]
) -> None:
    """On each host (one ssh each, all at once): TERM the pids and their children, KILL survivors."""
    base = _ssh_base(lo, 10)

    def one(location: str) -> None:
        cmd = (
            f"{shlex.quote(lo.remote_python)} -c {shlex.quote(_KILL_LEFT)} "
            f"{shlex.quote(json.dumps(sorted(pids.get(location, ()))))} "
            f"{shlex.quote(json.dumps(sorted(files.get(location, ()))))}"
        )
        try:
            proc = subprocess.run(
                [*base, location, cmd],
                capture_output=True,
                text=True,
                timeout=20,
                stdin=subprocess.DEVNULL,
                check=False,
            )
            if proc.returncode != 0:
                log.warning("nbtrain: stopping engines on %s: %s", location, proc.stderr.strip())
        except subprocess.TimeoutExpired:
            log.warning("nbtrain: could not check for left-over engines on %s", location)

    todo = sorted(set(pids) | set(files))
    if todo:
        with ThreadPoolExecutor(len(todo)) as pool:
            list(pool.map(one, todo))


def controller_pids(ipp_cluster: Any) -> list[int]:
    """The controller's pid here, if ipyparallel started one."""
    ctl = getattr(ipp_cluster, "controller", None) if ipp_cluster is not None else None
    return [int(ctl.pid)] if ctl is not None and getattr(ctl, "pid", None) else []


def stop_here(ipp_cluster: Any, local: Sequence[int]) -> bool:
    """ipyparallel's own stop (engines' launcher, then the controller), then whatever is left of
    `local` here: their children, and the process groups they lead (the controller's schedulers).
    False if ipyparallel's stop failed (the caller may have its own way to end the engines)."""
    from nbtrain.cluster import registry

    groups = _session_groups(local)
    stopped = True
    if ipp_cluster is not None:
        try:
            ipp_cluster.stop_cluster_sync()
        except Exception as e:
            log.debug("ipyparallel stop_cluster failed: %s", e)
            stopped = False
        registry.forget(ipp_cluster)
    _kill_tree(local)
    _kill_groups(groups)
    return stopped


def _teardown_remote(
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
    _kill_on_hosts(lo, pids, files)
    for engine_set in engine_sets:
        engine_set._nbtrain_killed = True
    stop_here(ipp_cluster, controller_pids(ipp_cluster))


# -- how engines get started: one class per launcher, the rest of a start is shared ---------------


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

    def _engine_set(self, ipp_cluster: Any) -> Any:
        """ipyparallel's engine set this start launched (one per start), or None before it has."""
        for es in getattr(ipp_cluster, "engines", {}).values():
            return es
        return None

    def restart_hint(self) -> str:
        return f"%nbtrain start --force --launcher {self.lo.launcher} with the same settings"


class SSHLaunch(EngineLaunch):
    """Engines on `--hosts` through ipyparallel's SSH engine launcher (started in parallel)."""

    what = "over SSH"

    def listen(self) -> net.ListenChoice:
        names = [s.host for s in self.lo.hosts]
        if self.lo.ip:
            for h in names:
                net.resolve(h)
            return net.ListenChoice(self.lo.ip, net.interface_of(self.lo.ip), "given with --ip")
        return net.listen_address(names)

    def prepare(self, options: StartOptions, remaining: Callable[[], float], say: Any) -> int:
        lo, specs = self.lo, self.lo.hosts
        checks = check_hosts(lo, remaining())
        # what can be told from the host checks fails here, before any engine starts; the same
        # checks run again on the engines (authoritative: an engine's environment may differ)
        for spec in specs:
            if lo.iface:
                net.require_interface(lo.iface, spec.host, checks[spec.host].interfaces)
        if lo.port is not None and checks[specs[0].host].port_in_use:
            msg = (
                f"port {lo.port} is already in use on {specs[0].host} (rank 0's host, where the "
                "rendezvous listens); pass a free port with --port, or leave --port out to pick a "
                "free one. Nothing was started."
            )
            raise ConfigError(msg)
        self.counts = engine_counts(lo, checks, options.backend)
        self.total = sum(self.counts.values())
        say(
            "starting engines over SSH: "
            + ", ".join(f"{self.counts[s.host]} on {s.host}" for s in specs)
        )
        return self.total

    def launcher_class(self) -> Any:
        return _ssh_engine_set_class()

    def configure(self, ipp_cluster: Any, options: StartOptions) -> None:
        lo = self.lo
        cfg = ipp_cluster.config.SSHEngineSetLauncher
        cfg.engines = {
            s.location: {
                "n": self.counts[s.host],
                "environment": {LAUNCH_HOST_ENV: s.host, **lo.host_env.get(s.host, {})},
            }
            for s in lo.hosts
        }
        ssh_base = _ssh_base(lo, min(30, options.timeout))
        cfg.ssh_args = ssh_base[1:]
        cfg.scp_args = [a for a in ssh_base[1:]]
        cfg.remote_python = lo.remote_python
        # nbtrain's entry point, as local, Slurm and MPI engines have it: torch imports while the
        # engine registers, and a stop ends the engine without a traceback in its log
        cfg.engine_cmd = [lo.remote_python, "-m", "nbtrain.engine.boot"]

    def raise_missing(
        self, client: Any, ipp_cluster: Any, listen: net.ListenChoice, timeout: float
    ) -> None:
        _raise_missing_engines(client, self.counts, listen, timeout)

    def host_order(self) -> list[str]:
        return [s.host for s in self.lo.hosts]

    def teardown(
        self, ipp_cluster: Any, client: Any, engine_pids: dict[str, list[int]], remove_logs: bool
    ) -> None:
        _teardown_remote(ipp_cluster, client, self.lo, engine_pids, remove_logs=remove_logs)

    def restart_hint(self) -> str:
        return "%nbtrain start --force with the same --hosts"


def engine_launch_for(lo: LaunchOptions) -> EngineLaunch:
    """The EngineLaunch for `lo.launcher`."""
    if lo.launcher == "slurm":
        from nbtrain.cluster.slurm import SlurmLaunch

        return SlurmLaunch(lo)
    if lo.launcher == "mpi":
        from nbtrain.cluster.mpi import MPILaunch

        return MPILaunch(lo)
    return SSHLaunch(lo)


# -- starting: shared by every launcher -----------------------------------------------------------


def start_remote(options: StartOptions, lo: LaunchOptions, quiet: bool = True) -> RemoteCluster:
    """Start a controller here and engines with `lo.launcher` (ssh, slurm, mpi); form the group."""
    import ipyparallel as ipp

    from nbtrain.cluster import registry

    deadline = time.monotonic() + options.timeout

    def remaining() -> float:
        return max(0.1, deadline - time.monotonic())

    def say(text: str) -> None:
        notes.append(text)
        log.info("nbtrain: %s", text)
        if not quiet:
            print(f"nbtrain: {text}", flush=True)

    notes: list[str] = []
    launch = engine_launch_for(lo)
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
        ipp_cluster.start_controller_sync()
        step = f"starting {total} engine(s) {launch.what}"
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
        step = "saying hello to the engines"
        ranks, engine_pids = _hello(client, launch.host_order(), remaining)
        step = "running preflight on every engine"
        result = _preflight(client, ranks, lo.allow_version_mismatch, remaining, say)
        step = "choosing the network interface of every node"
        master_addr = _plan_network(
            client, ranks, result.reports_by_rank, lo.iface, listen, remaining
        )
        step = "choosing the rendezvous port"
        port = _rendezvous_port(client, ranks, lo.port, remaining)
        say(
            f"rendezvous at {master_addr}:{port} (rank 0 on {ranks[0].host}, interface "
            f"{ranks[0].interface})"
        )
        step = "joining the process group"
        plan = _init_group(
            client,
            ranks,
            options,
            remaining,
            master_addr=master_addr,
            port=port,
            launcher=lo.launcher,
        )
    except BaseException as e:
        launch.teardown(ipp_cluster, client, engine_pids, False)
        if isinstance(e, (NbtrainError, KeyboardInterrupt)):
            raise
        msg = f"starting the cluster failed while {step}: {type(e).__name__}: {e}. Nothing was left running."
        raise ClusterError(msg) from e
    cluster = RemoteCluster(
        client,
        ipp_cluster,
        ranks,
        plan.backend,
        options,
        launch=lo,
        listen=listen,
        preflight=result.result,
        notes=notes,
        engine_pids=engine_pids,
        preflight_reports=result.reports_by_rank,
        engine_launch=launch,
    )
    cluster.plan = plan
    registry.write(cluster)
    return cluster


def _raise_missing_engines(
    client: Any, counts: dict[str, int], listen: net.ListenChoice, timeout: float
) -> None:
    from nbtrain.engine import network

    got: dict[str, int] = {}
    try:
        ids = list(client.ids)
        if ids:
            for h in (
                client.direct_view(targets=ids).apply_async(network.launch_host).get(timeout=10)
            ):
                got[h] = got.get(h, 0) + 1
    except Exception:
        pass
    short = [f"{h} ({got.get(h, 0)} of {n})" for h, n in counts.items() if got.get(h, 0) < n]
    msg = (
        f"not every engine registered within --timeout {timeout:g} s: missing on {', '.join(short)}. "
        f"Engines there could not reach the controller at {listen.address}: check that the host can "
        f"reach this machine at that address (a firewall?), pass --ip with an address it can "
        "reach, or give a longer --timeout. The engine log is in ~/.ipython/profile_nbtrain/log on "
        "that host. Nothing was left running."
    )
    raise ClusterError(msg)


def _hello(
    client: Any, host_order: Sequence[str], remaining: Callable[[], float]
) -> tuple[list[RankInfo], dict[str, list[int]]]:
    """Node-major ranks, and each launch label's engine pids (engine and its nanny).

    Hosts follow `host_order` (the --hosts entries) where given; otherwise, as for Slurm and MPI,
    the order of the launcher's task ids (SLURM_PROCID, the MPI rank): a host's place is that of
    its lowest task, and engines on a host follow their tasks. The ranks are nbtrain's own,
    contiguous per host, whatever order the launcher numbered its tasks in.
    """
    from nbtrain.engine import network, setup

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


@dataclass
class _Preflight:
    result: Any
    reports_by_rank: list[dict[str, Any]]


def _preflight(
    client: Any,
    ranks: Sequence[RankInfo],
    allow: bool,
    remaining: Callable[[], float],
    say: Callable[[str], None],
) -> _Preflight:
    from nbtrain.cluster.preflight import compare
    from nbtrain.engine import preflight as engine_preflight

    ids = [r.engine_id for r in ranks]
    reports = (
        client.direct_view(targets=ids)
        .apply_async(engine_preflight.collect)
        .get(timeout=remaining())
    )
    result = compare(list(reports), allow_version_mismatch=allow)
    result.raise_if_fatal()
    if result.mismatches:
        text = result.message()
        say(text.splitlines()[0])
        warnings.warn(text, stacklevel=4)
    return _Preflight(result, list(reports))


def _plan_network(
    client: Any,
    ranks: list[RankInfo],
    reports: Sequence[dict[str, Any]],
    iface: str | None,
    listen: net.ListenChoice,
    remaining: Callable[[], float],
) -> str:
    """Fill every rank's address and interface, set NCCL/GLOO_SOCKET_IFNAME; return MASTER_ADDR."""
    from nbtrain.engine import network

    leaders: dict[str, RankInfo] = {}
    for r in ranks:
        leaders.setdefault(r.host, r)
    hosts = list(leaders)
    plan: dict[str, tuple[str, str]] = {}  # host -> (address, interface)

    def ask(host: str, fn: Any, *args: Any) -> Any:
        return client[leaders[host].engine_id].apply_async(fn, *args)

    if iface:
        for host in hosts:
            nics = reports[leaders[host].rank].get("interfaces", {})
            available = {n: v.get("addresses", []) for n, v in nics.items()}
            net.require_interface(iface, host, available)
            v4 = [a for a in available[iface] if ":" not in a]
            if not v4:
                msg = (
                    f"interface {iface} on host {host} has no IPv4 address; pass --iface with an "
                    "interface that has one, or leave --iface out."
                )
                raise ConfigError(msg)
            plan[host] = (v4[0], iface)
    else:
        # every node's address toward the controller, then rank 0's toward another node, then every
        # other node's toward rank 0: the interfaces the process group's traffic will use
        toward_ctl = {h: ask(h, network.route, listen.address) for h in hosts}
        first = {h: ar.get(timeout=remaining()) for h, ar in toward_ctl.items()}
        h0 = hosts[0]
        if len(hosts) == 1:
            plan[h0] = (first[h0]["address"], first[h0]["interface"])
        else:
            r0 = ask(h0, network.route, first[hosts[1]]["address"]).get(timeout=remaining())
            plan[h0] = (r0["address"], r0["interface"])
            others = {h: ask(h, network.route, plan[h0][0]) for h in hosts[1:]}
            for h, ar in others.items():
                r = ar.get(timeout=remaining())
                plan[h] = (r["address"], r["interface"])
        for h, (address, nic) in plan.items():
            if nic in (None, "lo") and len(hosts) > 1:
                msg = (
                    f"host {h} would reach rank 0 through {nic or 'no interface'} ({address}); "
                    "the nodes need a network between them. Pass --iface with the interface "
                    "that connects them."
                )
                raise ClusterError(msg)
    pending = []
    for r in ranks:
        address, nic = plan[r.host]
        r.address, r.interface = address, nic
        env = {"NCCL_SOCKET_IFNAME": nic, "GLOO_SOCKET_IFNAME": nic}
        pending.append(client[r.engine_id].apply_async(network.set_env, env))
    for ar in pending:
        ar.get(timeout=remaining())
    return plan[hosts[0]][0]


def _rendezvous_port(
    client: Any, ranks: Sequence[RankInfo], port: int | None, remaining: Callable[[], float]
) -> int:
    from nbtrain.engine import network, setup

    rank0 = client[ranks[0].engine_id]
    if port is None:
        return int(rank0.apply_async(setup.free_port).get(timeout=remaining()))
    if rank0.apply_async(network.port_in_use, int(port)).get(timeout=remaining()):
        msg = (
            f"port {port} is already in use on {ranks[0].host} (rank 0's host, where the rendezvous "
            "listens); pass a free port with --port, or leave --port out to pick a free one. "
            "Nothing was left running."
        )
        raise ConfigError(msg)
    return int(port)


def describe_start(cluster: Cluster) -> str:
    """The lines `%nbtrain start` prints for a multi-node cluster, before the rank table."""
    lines = [f"nbtrain: {n}" for n in getattr(cluster, "notes", [])]
    return "\n".join(lines)


# -- attaching to a cluster started elsewhere ------------------------------------------------------


def _find_ipp_cluster(cluster_id: str | None, profile: str | None, file: str | None) -> Any:
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
    cluster_id: str | None = None,
    *,
    profile: str | None = None,
    file: str | None = None,
    iface: str | None = None,
    port: int | None = None,
    backend: str = "auto",
    timeout: float = 120.0,
    allow_version_mismatch: bool = False,
    force: bool = False,
    quiet: bool = True,
) -> RemoteCluster:
    """Attach to an ipyparallel cluster started any way; give its engines ranks and a process group.

    In [1]: cluster = nbtrain.connect(profile="mpi")      # twin of %nbtrain connect --profile mpi

    Stopping the returned cluster leaves its engines running (whoever started them stops them).
    """
    from nbtrain.cluster import core

    options = StartOptions(backend=backend, timeout=timeout, force=force)
    existing = core.current_cluster()
    if existing is not None:
        if not force:
            msg = (
                f"a cluster is already running ({existing.world_size} rank(s) on "
                f"{', '.join(existing.hosts)}). Stop it with %nbtrain stop, or pass --force."
            )
            raise ClusterError(msg)
        existing.stop()
    deadline = time.monotonic() + timeout

    def remaining() -> float:
        return max(0.1, deadline - time.monotonic())

    ipp_cluster = _find_ipp_cluster(cluster_id, profile, file)
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
        from nbtrain.engine import setup

        dv = client.direct_view(targets=ids)
        hellos = dict(zip(ids, dv.apply_async(setup.hello).get(timeout=remaining())))
        ranks = assign_ranks(hellos)
        options.n = len(ranks)
        notes: list[str] = []
        result = _preflight(client, ranks, allow_version_mismatch, remaining, notes.append)
        # the controller's address as this client reaches it; where that is loopback but engines
        # run elsewhere, this machine's address on the route to their hosts
        m = re.search(r"//\[?([^\]/]+?)\]?$", str(client._config.get("interface", "")))
        ctl = m.group(1) if m and m.group(1) not in ("*", "0.0.0.0") else net.LOOPBACK
        local_only = all(r.host == socket.gethostname() for r in ranks)
        if ipaddress.ip_address(ctl).is_loopback and not local_only:
            listen = net.listen_address([r.host for r in ranks])
        else:
            listen = net.ListenChoice(ctl, net.interface_of(ctl), "the connected controller")
        master_addr = _plan_network(client, ranks, result.reports_by_rank, iface, listen, remaining)
        port_ = _rendezvous_port(client, ranks, port, remaining)
        plan = _init_group(
            client,
            ranks,
            options,
            remaining,
            master_addr=master_addr,
            port=port_,
            launcher="connect",
        )
    except BaseException:
        _leave(client, [])
        raise
    cluster = RemoteCluster(
        client,
        None,
        ranks,
        plan.backend,
        options,
        preflight=result.result,
        notes=notes,
        preflight_reports=result.reports_by_rank,
    )
    cluster.plan = plan
    core._current = cluster
    if not quiet:
        for n in notes:
            print(f"nbtrain: {n}")
    return cluster
