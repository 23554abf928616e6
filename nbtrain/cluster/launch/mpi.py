"""Engines started by mpiexec: ipyparallel's MPI engine launcher, without mpi4py on the engines.

In [1]: cluster = nbtrain.start(launcher="mpi", n=8)          # %nbtrain start --launcher mpi -n 8
In [2]: cluster = nbtrain.start(launcher="mpi", hosts="node1:4,node2:4")   # one mpiexec, two hosts

mpiexec starts every engine (`mpiexec -n N [--host ...] python -m nbtrain.engine.boot`); the
controller runs here. nbtrain numbers the ranks itself, node-major and contiguous per host: MPI's
rank decides the order of the hosts (a host comes where its lowest MPI rank is) and of the engines
on a host, and RANK/LOCAL_RANK follow nbtrain's numbering, which is MPI's whenever mpiexec places
ranks by slot (its default).
"""

from __future__ import annotations

import logging
import re
import shutil
import socket
import subprocess
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from ipyparallel.cluster.launcher import MPIEngineSetLauncher

from nbtrain import net, procs
from nbtrain.cluster.launch import LaunchOptions
from nbtrain.cluster.launch.base import NETWORK, PYTHON, EngineLaunch, start_engines, stop_here
from nbtrain.cluster.options import MPIEXEC, Option, StartOptions
from nbtrain.cluster.session import Launched, close_client
from nbtrain.errors import ClusterError, ConfigError

log = logging.getLogger(__name__)

#: what --launcher mpi does, in --launcher's help
SUMMARY = "under one mpiexec -n N"
OPTIONS = (
    Option(
        "n",
        "ranks: mpiexec -n (default: the slots in --hosts, else 1)",
        kind="count",
        flag="-n",
        example="4",
        metavar="N",
        default_doc="the slots in `--hosts`, else 1",
    ),
    Option(
        "hosts",
        "HOST[:SLOTS],... e.g. node1:4,node2:4 (slots default to 1)",
        kind="hosts",
        example="node1:4,node2:4",
        doc="`HOST[:SLOTS],...` in rank order, e.g. `node1:4,node2:4`; slots default to 1",
    ),
    Option(
        "mpi_args",
        'more mpiexec arguments, e.g. "--oversubscribe"',
        kind="args",
        default=[],
        metavar="ARGS",
        doc='more mpiexec arguments: `"--oversubscribe"`, `"--mca btl_tcp_if_include eth0"`',
    ),
    *NETWORK,
    PYTHON,
)
HINT = "give the ranks with -n (and --hosts for several hosts)"


def validate(lo: LaunchOptions) -> None:
    """Settle the rank count from -n and --hosts; the hosts are known here; mpiexec is on PATH."""
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
    for h in lo.hosts:
        net.resolve(h.host)  # an unknown host fails here, naming it, before anything starts


# what the engines need from the kernel's side; Open MPI passes only what -x names to other hosts
_EXPORT = ("IPP_CONNECTION_INFO", "IPP_CLUSTER_ID", "IPP_PROFILE_DIR")


@lru_cache(maxsize=4)
def flavour(mpiexec: str = MPIEXEC) -> str:
    """'openmpi' or 'hydra' (MPICH, Intel MPI): they spell their host lists differently."""
    try:
        out = subprocess.run(
            [mpiexec, "--version"], capture_output=True, text=True, timeout=20, check=False
        )
        text = out.stdout + out.stderr
    except (OSError, subprocess.TimeoutExpired):
        text = ""
    return "openmpi" if re.search(r"Open MPI|OpenRTE", text) else "hydra"


def mpi_args(lo: LaunchOptions, kind: str) -> list[str]:
    """mpiexec's arguments besides -n and the program: hosts, exported variables, the user's own."""
    args: list[str] = []
    if lo.hosts:
        hosts = ",".join(f"{h.host}:{h.engines or 1}" for h in lo.hosts)
        args += ["--host", hosts] if kind == "openmpi" else ["-hosts", hosts]
    if kind == "openmpi":
        for name in _EXPORT:
            args += ["-x", name]
    return args + list(lo.mpi_args)


class MPIEngineSet(MPIEngineSetLauncher):
    """ipyparallel's MPI engine set, starting engines without `--mpi`.

    ipengine's --mpi imports mpi4py on every engine to take the MPI rank as engine id; nbtrain
    numbers ranks itself (from the MPI rank in the environment), so engines need no mpi4py.
    """

    entrypoint_name = "nbtrain.cluster.launch.mpi.MPIEngineSet"
    # ipyparallel removes the output when mpiexec exits; kept until nbtrain's teardown, since a
    # failed start quotes it and points at it
    keep_output = True

    def get_output(self, remove: bool = True) -> str:
        return str(super().get_output(remove=remove and not self.keep_output))

    @property
    def program(self) -> list[str]:  # type: ignore[override]
        return list(self.engine_cmd)


def _exited(es: Any) -> bool:
    """Whether mpiexec has exited (ipyparallel's waiting thread may already have reaped it)."""
    proc = getattr(es, "process", None)
    if proc is None:
        return False
    return not procs.running(proc)


def _exit_code(es: Any) -> int | None:
    data = getattr(es, "stop_data", None) or {}
    code = data.get("exit_code") if isinstance(data, dict) else None
    return int(code) if code is not None else None


def _output(es: Any) -> str:
    try:
        with open(es.output_file) as f:
            return f.read()
    except (OSError, AttributeError):
        return ""


def _abridge(text: str, head: int = 10, tail: int = 10) -> str:
    # Open MPI says what went wrong at the top of its block; a Python traceback ends at the bottom
    lines = [ln for ln in text.splitlines() if ln.strip("-")]
    if len(lines) <= head + tail:
        return "\n".join(lines)
    return "\n".join([*lines[:head], "...", *lines[-tail:]])


def explain_exit(code: int | None, output: str) -> str:
    """The message for an mpiexec that ended before its engines registered."""
    if "run as root" in output or "allow-run-as-root" in output:
        return (
            "mpiexec refused to run as root (Open MPI does unless told to). Run the notebook as a "
            "normal user; or, if this machine must run it as root, set OMPI_ALLOW_RUN_AS_ROOT=1 and "
            "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 in the kernel's environment (or pass --mpi-args "
            "--allow-run-as-root). Nothing was left running."
        )
    hint = "See mpiexec's message above."
    if "slots" in output and ("not enough" in output or "insufficient" in output.lower()):
        hint = (
            "There are fewer slots (cores) than ranks: ask for fewer with -n, list hosts with "
            "their slots in --hosts, or pass --mpi-args --oversubscribe."
        )
    elif "No module named" in output or "not found" in output:
        hint = (
            "Pass --python with the Python that has nbtrain installed, the same path on every host."
        )
    elif "ssh" in output.lower() or "orted" in output:
        hint = (
            "mpiexec could not start its daemons on the other hosts: make `ssh HOST true` work "
            "without a password and install the same MPI there."
        )
    return (
        f"mpiexec exited{f' (code {code})' if code is not None else ''} before its engines "
        f"registered:\n{_abridge(output)}\n{hint} Nothing was left running."
    )


class MPILaunch(EngineLaunch):
    """Engines started by one mpiexec -n N (on --hosts, or on this machine)."""

    what = "with mpiexec"

    def __init__(self, lo: LaunchOptions) -> None:
        super().__init__(lo)
        self.total = int(lo.n or 1)

    def listen(self) -> net.ListenChoice:
        if self.lo.ip:
            return net.ListenChoice(self.lo.ip, net.interface_of(self.lo.ip), "given with --ip")
        if not self.lo.hosts:
            return net.ListenChoice(
                net.LOOPBACK, net.interface_of(net.LOOPBACK), "every rank is on this machine"
            )
        return net.listen_address([h.host for h in self.lo.hosts])

    def prepare(self, options: StartOptions, remaining: Callable[[], float], say: Any) -> int:
        where = (
            ", ".join(f"{h.engines or 1} on {h.host}" for h in self.lo.hosts)
            if self.lo.hosts
            else f"on {socket.gethostname()}"
        )
        say(f"starting {self.total} engine(s) with {MPIEXEC} ({flavour()}): {where}")
        return self.total

    def launcher_class(self) -> Any:
        return MPIEngineSet

    def configure(self, ipp_cluster: Any, options: StartOptions) -> None:
        cfg = ipp_cluster.config.MPIEngineSet
        cfg.mpi_cmd = [MPIEXEC]
        cfg.mpi_args = mpi_args(self.lo, flavour())
        cfg.engine_cmd = [self.lo.remote_python, "-m", "nbtrain.engine.boot"]
        log.debug("mpi: %s", " ".join([*cfg.mpi_cmd, *cfg.mpi_args, "-n", "N", *cfg.engine_cmd]))

    def watch(self, ipp_cluster: Any, say: Any, force: bool = False) -> None:
        es = self._engine_set(ipp_cluster)
        if es is None:
            return
        gone = _exited(es)
        if not gone and force:
            try:  # ipyparallel saw it end: the process is a moment from gone
                es.process.wait(timeout=5)
            except Exception:
                log.debug(
                    "mpiexec did not end within 5 s of ipyparallel seeing it end", exc_info=True
                )
            gone = _exited(es)
        if gone:
            raise ClusterError(explain_exit(_exit_code(es), _output(es)))

    def raise_missing(
        self, client: Any, ipp_cluster: Any, listen: net.ListenChoice, timeout: float
    ) -> None:
        self.watch(ipp_cluster, None)
        es = self._engine_set(ipp_cluster)
        where = (
            f"could not reach the controller at {listen.address}: pass --ip with an address of "
            "this machine the hosts reach"
            if self.lo.hosts
            else "are slow to start or failed"
        )
        msg = (
            f"not every engine registered within --timeout {timeout:g} s ({len(client.ids)} of "
            f"{self.total}). The engines {where}, or give a longer --timeout. mpiexec's output is "
            f"in {getattr(es, 'output_file', '?')}. Nothing was left running."
        )
        raise ClusterError(msg)

    def teardown(
        self, ipp_cluster: Any, client: Any, engine_pids: dict[str, list[int]], remove_logs: bool
    ) -> None:
        close_client(client)
        ctl = procs.controller_pids(ipp_cluster)
        local = list(ctl)
        es = self._engine_set(ipp_cluster)
        if es is not None and getattr(es, "pid", None):
            local.append(int(es.pid))  # mpiexec: ending it ends its ranks, on every host
        me = socket.gethostname()
        for host, pids in engine_pids.items():
            if host == me or net.is_local(host):
                local.extend(pids)
        # the engines here first, all at once: mpiexec then ends by itself instead of sitting out
        # ipyparallel's 5 s between TERM and KILL
        first = [p for p in local if p not in ctl]
        procs.terminate(first + procs.descendants(first), grace=2.0)
        if es is not None:
            es.keep_output = not remove_logs
        stop_here(ipp_cluster, local)


def start(options: StartOptions, lo: LaunchOptions | None, quiet: bool = True) -> Launched:
    """Engines with --launcher mpi; a controller here; the group across them."""
    assert lo is not None
    return start_engines(MPILaunch(lo), options, quiet=quiet)
