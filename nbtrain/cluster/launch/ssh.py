"""The SSH launcher: engines on `--hosts`, through ipyparallel's SSH engine launcher, in parallel.

In [1]: cluster = nbtrain.start(launcher="ssh", hosts="node1:2,node2:2")

Every host is logged in to first (`check_hosts`): an unreachable host, a refused key, a missing
Python or nbtrain fail there, with ssh's own message, before anything starts.
"""

from __future__ import annotations

import json
import logging
import shlex
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from nbtrain import net
from nbtrain.cluster.launch import LaunchOptions
from nbtrain.cluster.launch.base import (
    NETWORK,
    PYTHON,
    EngineLaunch,
    ssh_base,
    ssh_run,
    start_engines,
    teardown_remote,
)
from nbtrain.cluster.options import LAUNCH_HOST_ENV, Option, StartOptions
from nbtrain.cluster.ranks.plan import Slot, plan_devices
from nbtrain.cluster.session import Launched
from nbtrain.engine import network
from nbtrain.errors import ClusterError, ConfigError

log = logging.getLogger(__name__)

#: what --launcher ssh does, in --launcher's help
SUMMARY = "on --hosts over SSH"
OPTIONS = (
    Option(
        "hosts",
        "HOST[:ENGINES],... e.g. node1:2,node2:2 (engines default to the host's GPU count, 1 on CPU)",
        kind="hosts",
        example="node1:2,node2:2",
        doc="`HOST[:ENGINES],...` in rank order, e.g. `node1:2,node2:2`; engines default to the "
        "host's GPU count, 1 on CPU",
        label="Hosts:engines",
        placeholder="node1:2,node2:2",
    ),
    *NETWORK,
    PYTHON,
    Option(
        "ssh_args",
        'extra ssh arguments, e.g. "-F ~/.ssh/cluster"',
        kind="args",
        default=[],
        metavar="ARGS",
        label="ssh arguments",
        placeholder="e.g. -F ~/.ssh/cluster",
    ),
    Option(
        "host_env",
        "environment for one host's engines: {host: {NAME: value}}",
        kind="mapping",
        default={},
        flag=None,
    ),
)
HINT = "give the engines per host in --hosts (node1:2,node2:2)"


def validate(lo: LaunchOptions) -> None:
    """The hosts are given, and known by name here; host_env names only hosts in --hosts."""
    if not lo.hosts:
        msg = "--launcher ssh needs --hosts, e.g. --hosts node1:2,node2:2"
        raise ConfigError(msg)
    for h in lo.hosts:
        net.resolve(h.host)  # an unknown host fails here, naming it, before anything starts
    known = {h.host for h in lo.hosts}
    for host in lo.host_env:
        if host not in known:
            msg = f"host_env names {host!r}, which is not in --hosts ({', '.join(known)})."
            raise ConfigError(msg)


def start(options: StartOptions, lo: LaunchOptions | None, quiet: bool = True) -> Launched:
    """Engines over SSH on `lo.hosts`; a controller here; the group across them."""
    assert lo is not None
    return start_engines(SSHLaunch(lo), options, quiet=quiet)


def ssh_engine_set_class() -> type:
    """ipyparallel's SSH engine set launcher, starting the hosts' engines in parallel."""
    from nbtrain.cluster.launch.ssh_engines import ParallelSSHEngineSetLauncher

    return ParallelSSHEngineSetLauncher


_HOST_CHECK = """
import json, os, socket, sys
out = {"hostname": socket.gethostname(), "python": sys.executable}
try:
    import nbtrain
    from nbtrain.engine.setup import cuda_count
    out["nbtrain"] = nbtrain.__version__
    out["gpus"] = cuda_count()
    from nbtrain.engine.preflight import network_interfaces
    out["interfaces"] = {n: v["addresses"] for n, v in network_interfaces().items()}
    if len(sys.argv) > 1:
        from nbtrain.net import port_in_use
        out["port_in_use"] = port_in_use(int(sys.argv[1]))
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
print("NBTRAIN_HOST_CHECK " + json.dumps(out))
"""


@dataclass
class HostCheck:
    """What a host said over SSH before anything started: its name, GPUs, interfaces."""

    host: str
    hostname: str
    gpus: int
    interfaces: dict[str, list[str]] = field(default_factory=dict)
    port_in_use: bool | None = None  # for --port, asked on the first host (rank 0's) only


def check_hosts(lo: LaunchOptions, timeout: float) -> dict[str, HostCheck]:
    """Log in to every host at once and ask its Python for nbtrain and the GPU count.

    This is where the errors users meet on a new cluster surface, with ssh's own message: an
    unreachable host, a refused key, a missing Python or nbtrain.
    """

    def one(spec: net.HostSpec) -> HostCheck:
        # the engines' environment on that host (CUDA_VISIBLE_DEVICES changes the GPU count)
        env = [f"{k}={v}" for k, v in lo.host_env.get(spec.host, {}).items()]
        prefix = "env " + " ".join(shlex.quote(e) for e in env) + " " if env else ""
        cmd = f"{prefix}{shlex.quote(lo.remote_python)} -c {shlex.quote(_HOST_CHECK)}"
        if lo.port is not None and spec is lo.hosts[0]:
            cmd += f" {int(lo.port)}"
        try:
            proc = ssh_run(lo, spec.location, cmd, timeout)
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
            except Exception as e:  # the first host's error is raised below, once all have ended
                first_error = first_error or e
    if first_error is not None:
        raise first_error
    return results


def engine_counts(lo: LaunchOptions, checks: dict[str, HostCheck], backend: str) -> dict[str, int]:
    """Engines per host: as given, else the host's GPU count (1 without GPUs).

    `--backend nccl` where a host would have more engines than GPUs fails here, before any engine
    starts, with the device plan's own message; the plan decides again on the engines' GPU counts.
    """
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
        return ssh_engine_set_class()

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
        base = ssh_base(lo, min(30, options.timeout))
        cfg.ssh_args = base[1:]
        cfg.scp_args = [a for a in base[1:]]
        cfg.remote_python = lo.remote_python
        # nbtrain's entry point, as local, Slurm and MPI engines have it: torch imports while the
        # engine registers, and a stop ends the engine without a traceback in its log
        cfg.engine_cmd = [lo.remote_python, "-m", "nbtrain.engine.boot"]

    def raise_missing(
        self, client: Any, ipp_cluster: Any, listen: net.ListenChoice, timeout: float
    ) -> None:
        raise_missing_engines(client, self.counts, listen, timeout)

    def host_order(self) -> list[str]:
        return [s.host for s in self.lo.hosts]

    def teardown(
        self, ipp_cluster: Any, client: Any, engine_pids: dict[str, list[int]], remove_logs: bool
    ) -> None:
        teardown_remote(ipp_cluster, client, self.lo, engine_pids, remove_logs=remove_logs)

    def restart_hint(self) -> str:
        return "%nbtrain start --force with the same --hosts"


def raise_missing_engines(
    client: Any, counts: dict[str, int], listen: net.ListenChoice, timeout: float
) -> None:
    """--timeout passed before every engine registered: name the hosts short of engines."""
    got: dict[str, int] = {}
    try:
        ids = list(client.ids)
        if ids:
            for h in (
                client.direct_view(targets=ids).apply_async(network.launch_host).get(timeout=10)
            ):
                got[h] = got.get(h, 0) + 1
    except Exception:
        # the message below names the short hosts without the engines' own answer
        log.debug("the registered engines did not say their hosts", exc_info=True)
    short = [f"{h} ({got.get(h, 0)} of {n})" for h, n in counts.items() if got.get(h, 0) < n]
    msg = (
        f"not every engine registered within --timeout {timeout:g} s: missing on {', '.join(short)}. "
        f"Engines there could not reach the controller at {listen.address}: check that the host can "
        f"reach this machine at that address (a firewall?), pass --ip with an address it can "
        "reach, or give a longer --timeout. The engine log is in ~/.ipython/profile_nbtrain/log on "
        "that host. Nothing was left running."
    )
    raise ClusterError(msg)
