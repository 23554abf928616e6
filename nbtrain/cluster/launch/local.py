"""The local launcher: a controller and engines on this machine (`nbtrain.start(n=2)`).

Engines start as `python -m nbtrain.engine.boot`, so torch imports while they register; the group
meets on loopback (`group.loopback_env`). This is the one launcher that can replace single engines.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

from nbtrain import procs
from nbtrain.cluster import allocator, registry
from nbtrain.cluster.failures import start_failed
from nbtrain.cluster.group import free_local_port, init_group, reinit
from nbtrain.cluster.launch import LaunchOptions
from nbtrain.cluster.options import (
    HEARTBEAT_MS,
    Option,
    StartOptions,
    idle_timeout,
    local_gpu_count,
)
from nbtrain.cluster.ranks.topology import assign_ranks, compact
from nbtrain.cluster.session import Launched, Session, adopt, close_client, new_engines
from nbtrain.engine import setup
from nbtrain.errors import ClusterError

log = logging.getLogger(__name__)

#: what --launcher local does, in --launcher's help
SUMMARY = "engines on this machine"
# -n is %nbtrain start's own (StartOptions.n); declared here so that another launcher given it
# names local among those that take it
OPTIONS = (
    Option(
        "n",
        "engines on this machine (default: one per GPU, or 1 without GPUs)",
        kind="count",
        flag="-n",
        example="2",
        metavar="N",
        default_doc="one per GPU, or 1 without GPUs",
    ),
)


def engine_environment(options: StartOptions) -> dict[str, str]:
    """What every local engine gets in its environment at launch, before anything imports torch.

    The user's `env` first; then, as torchrun does, one share of the cores per rank
    (OMP_NUM_THREADS), since several ranks that each use every core thrash the CPU; and on a machine
    without GPUs, tcmalloc preloaded where installed (`nbtrain.cluster.allocator`).
    """
    env = dict(options.extra_env)
    if "OMP_NUM_THREADS" not in env and "OMP_NUM_THREADS" not in os.environ and options.n > 1:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // options.n))
    env.update(allocator.engine_env(options.allocator or "auto", env, local_gpu_count()))
    return env


def start(options: StartOptions, lo: LaunchOptions | None = None, quiet: bool = True) -> Launched:
    """Start a controller and `options.n` engines on this machine, and a process group across them."""
    import ipyparallel as ipp

    deadline = time.monotonic() + options.timeout

    def remaining() -> float:
        return max(0.1, deadline - time.monotonic())

    cluster_id = f"nbtrain-{uuid.uuid4().hex[:8]}"
    ipp_cluster = ipp.Cluster(
        n=options.n,
        engine_launcher_class="local",
        profile=options.profile,
        cluster_id=cluster_id,
        controller_ip="127.0.0.1",
        controller_args=[f"--HeartMonitor.period={HEARTBEAT_MS}"],
        # engines wait for the connection file themselves, so they start while the controller does
        send_engines_connection_env=False,
        log_level=logging.ERROR,
        # nbtrain stops its clusters at exit itself, all processes at once; ipyparallel's own atexit
        # stop is serial and slow enough that a restarting kernel gets killed halfway through it
        shutdown_atexit=False,
    )
    # engines import torch while they wait for the controller (nbtrain.engine.boot), so the thread
    # settings torch reads at import must be in their environment from the start
    ipp_cluster.config.LocalEngineSetLauncher.engine_cmd = [
        sys.executable,
        "-m",
        "nbtrain.engine.boot",
    ]
    ipp_cluster.config.LocalEngineSetLauncher.environment = engine_environment(options)
    client = None
    pids: list[int] = []
    step = "starting the controller"
    try:
        log.info("cluster %s: starting the controller on 127.0.0.1", cluster_id)
        ipp_cluster.start_controller_sync()
        step = f"starting {options.n} engine(s)"
        log.info(
            "cluster %s: starting %d engine(s) here: %s -m nbtrain.engine.boot, environment %s",
            cluster_id,
            options.n,
            sys.executable,
            ipp_cluster.config.LocalEngineSetLauncher.environment,
        )
        ipp_cluster.start_engines_sync(options.n)
        step = "connecting to the controller"
        client = ipp_cluster.connect_client_sync()
        step = f"waiting for {options.n} engine(s) to register"
        try:
            client.wait_for_engines(options.n, timeout=remaining(), interactive=False)
        except TimeoutError:
            got = len(client.ids)
            msg = (
                f"only {got} of {options.n} engine(s) started within --timeout {options.timeout:g} s on "
                f"{socket.gethostname()}. Nothing was left running. Try a longer --timeout, fewer engines, "
                f"or look at the engine logs in {ipp_cluster.profile_dir}/log."
            )
            raise ClusterError(msg) from None
        step = "saying hello to the engines"
        dv = client[:]
        hellos_list = dv.apply_async(setup.hello).get(timeout=remaining())
        hellos = {eid: h for eid, h in zip(dv.targets, hellos_list)}
        pids = [p for h in hellos.values() for p in [h["pid"], *h.get("children", [])]]
        ranks = assign_ranks(hellos)
        log.info("cluster %s: %d engine(s) up, pids %s", cluster_id, len(ranks), pids)
        step = "joining the process group"
        plan = init_group(
            client,
            ranks,
            options,
            remaining,
            master_addr="127.0.0.1",
            port=free_local_port(),
            run_id=ipp_cluster.cluster_id,
        )
    except BaseException as e:
        log.info("cluster %s: start failed while %s (%s); tearing down", cluster_id, step, e)
        teardown(ipp_cluster, client, pids)
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
        launcher="local",
        stop=stop,
        replace=replace,
        pids=pids,
        allocator=",".join(sorted({h.get("allocator", "system") for h in hellos.values()})),
        on_ready=_ready,
    )


def _ready(session: Session) -> None:
    registry.write(session)
    # stops the cluster if its kernel dies and nothing runs on it for NBTRAIN_IDLE_TIMEOUT seconds
    watchdog = spawn_watchdog(session)
    if watchdog is not None:
        session.pids.append(watchdog)


def spawn_watchdog(session: Session) -> int | None:
    """Start the idle watchdog of a local cluster; returns its pid (stopping the cluster kills it)."""
    path = registry.side_file(session.ipp_cluster)
    if path is None:
        return None
    proc = subprocess.Popen(
        [sys.executable, "-m", "nbtrain.cluster.faults.watchdog", str(path), str(idle_timeout())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )
    return proc.pid


def stop(session: Session) -> None:
    """Stop every engine, nanny, the controller and the watchdog of a local session."""
    teardown(session.ipp_cluster, session.client, session.pids)


def teardown(ipp_cluster: Any, client: Any, pids: Sequence[int]) -> None:
    """Stop a local cluster: every engine, nanny, the controller and the watchdog, all at once.

    ipyparallel's own stop signals the processes one after another and waits several seconds, but a
    kernel restart gives us about 2.5 s before it is killed itself: so terminate everything we know of
    together, kill what is left after a short grace, and only then let ipyparallel tidy its files.
    """
    close_client(client)
    local: list[int] = list(pids)
    if ipp_cluster is not None:
        local.extend(procs.launcher_pids(ipp_cluster))
    log.info("stopping local cluster %s: pids %s", getattr(ipp_cluster, "cluster_id", None), local)
    local.extend(procs.descendants(local))
    groups = procs.session_groups(local)
    # engines (IPython kernels) sit on SIGTERM for seconds; their state is being discarded anyway
    procs.terminate(local, grace=0.5)
    if ipp_cluster is not None:
        try:
            ipp_cluster.stop_cluster_sync()
        except Exception as e:
            log.debug("ipyparallel stop_cluster failed: %s", e)
        registry.forget(ipp_cluster)
    procs.kill_groups(groups)


def replace(session: Session, ranks: Sequence[int], timeout: float) -> None:
    """Replace the engines of `ranks` with fresh ones and re-create the process group everywhere."""
    if session.ipp_cluster is None:
        msg = (
            f"rank(s) {compact(list(ranks))} are stuck, and this cluster was connected, not started, by "
            "nbtrain, so it cannot replace their engines. Restart the cluster where it was started."
        )
        raise ClusterError(msg)
    deadline = time.monotonic() + timeout

    def remaining() -> float:
        return max(0.1, deadline - time.monotonic())

    dead_ids = {session.ranks[r].engine_id for r in ranks}
    orphans = procs.kill_with_children([session.ranks[r].pid for r in ranks])
    # the nanny tells the hub at once; wait until the client no longer lists the old engines
    while dead_ids & set(session.client.ids) and time.monotonic() < deadline:
        time.sleep(0.05)
    procs.kill_tree(orphans, grace=1.0)
    before = set(session.client.ids)
    log.info("replacing the engines of ranks %s (old pids %s)", list(ranks), orphans)
    session.ipp_cluster.start_engines_sync(len(ranks))
    for r, (eid, h) in zip(sorted(ranks), new_engines(session, before, len(ranks), remaining)):
        adopt(session.ranks[r], eid, h)
        session.pids.extend([int(h["pid"]), *h.get("children", [])])
    reinit(session, timeout=remaining())
