"""The process group: plan the backend, have every rank join, re-create or repair it.

The one place a process group is made: local, remote and connected starts, a re-init after an
interrupt broke it, a restart that replaced engines. Works on the rank table and a client (or a
`Session`); knows nothing of how the engines were started.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

from nbtrain import logs
from nbtrain.cluster import registry
from nbtrain.cluster.options import StartOptions
from nbtrain.cluster.ranks.plan import DevicePlan, Slot, plan_devices
from nbtrain.cluster.ranks.ranges import parse_ranks
from nbtrain.cluster.ranks.topology import RankInfo, compact, describe_ranks, torchrun_env
from nbtrain.cluster.session import Session
from nbtrain.engine import groups as engine_groups
from nbtrain.engine import setup
from nbtrain.errors import ClusterError, ConfigError

log = logging.getLogger(__name__)

# a registry.write that failed: the cluster works on, but its record on disk is stale
RECORD_FAILED = (
    "nbtrain: cluster %s (%s): its record could not be written (%s: %s); a kernel that attaches "
    "later sees the record as it was before"
)

# how long the other ranks get to finish joining the group once one rank failed to (they are
# usually blocked in the rendezvous, waiting for it)
FAILED_GRACE_S = 2.0


def free_local_port() -> int:
    """A TCP port free on this machine's loopback right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def loopback_env(
    ranks: Sequence[RankInfo], master_addr: str, port: int, options: StartOptions
) -> dict[str, str]:
    """A cluster on this machine alone keeps its process group off the network.

    torch's TCPStore listens on every interface, so local ranks meet through a FileStore in the profile's
    security folder (0700) instead, and gloo's pairs use the loopback interface.
    """
    if master_addr != "127.0.0.1" or any(r.host != socket.gethostname() for r in ranks):
        return {}
    from IPython.paths import get_ipython_dir

    folder = os.path.join(get_ipython_dir(), f"profile_{options.profile}", "security")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    store = os.path.join(folder, f".nbtrain-store-{os.getpid()}-{port}")
    return {"NBTRAIN_STORE_FILE": store, "GLOO_SOCKET_IFNAME": "lo"}


# the FileStore files (loopback_env) this kernel's clusters meet through, by cluster id: ranks
# killed at a stop never remove theirs, so the kernel does (remove_store_files)
_STORE_FILES: dict[str, set[str]] = {}


def remove_store_files(cluster_id: str | None) -> None:
    """Remove the FileStore files of a stopped cluster (the group's rendezvous, nothing else)."""
    for path in _STORE_FILES.pop(cluster_id or "nbtrain", set()):
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.debug("could not remove %s: %s", path, e)


def init_group(
    client: Any,
    ranks: list[RankInfo],
    options: StartOptions,
    remaining: Callable[[], float],
    master_addr: str,
    port: int,
    launcher: str = "local",
    announce: bool = True,
    run_id: str | None = None,
    restart_count: int = 0,
) -> DevicePlan:
    """Plan the backend and every rank's device here, then have every rank join the group with them.

    The one place a process group is made (local, remote and connected starts, re-init after an
    interrupt or a restart), and so the one place every rank gets torchrun's environment
    (`topology.torchrun_env`: `run_id` is the cluster id, `restart_count` the re-inits so far).
    Prints the plan's why-line when `announce`.
    """
    plan = plan_devices(
        [Slot(r.host, r.local_rank, r.gpus, r.pinned) for r in ranks],
        options.backend,
        launcher=launcher,
    )
    if plan.why and announce:
        log.info("nbtrain: %s", plan.why)
        print(f"nbtrain: {plan.why}", flush=True)
    pending = []
    loopback = loopback_env(ranks, master_addr, port, options)
    if loopback:
        _STORE_FILES.setdefault(run_id or "nbtrain", set()).add(loopback["NBTRAIN_STORE_FILE"])
    for r in ranks:
        env = {
            **torchrun_env(ranks, r, master_addr, port, run_id or "nbtrain", restart_count),
            # the cluster a run on this rank belongs to, in its run record (nbtrain.telemetry.report)
            **({"NBTRAIN_CLUSTER_ID": run_id} if run_id else {}),
            **loopback,
            # the kernel's log level (NBTRAIN_LOG), applied by init_rank (nbtrain.logs)
            **logs.engine_env(),
            **options.extra_env,
        }
        r.address = master_addr if r.rank == 0 else r.address
        ar = client[r.engine_id].apply_async(
            setup.init_rank, env, plan.backend, plan.devices[r.rank], options.pg_timeout
        )
        pending.append((r, ar))
    failures: list[tuple[RankInfo, BaseException]] = []
    late: list[RankInfo] = []
    # a rank that failed leaves the others waiting in the rendezvous for it: report the failure
    # after a short grace instead of sitting out --timeout and blaming the network
    failed_at: float | None = None
    todo = list(pending)
    while todo:
        now = time.monotonic()
        if remaining() <= 0.1 or (failed_at is not None and now - failed_at > FAILED_GRACE_S):
            late = [r for r, _ in todo]
            break
        r, ar = todo[0]
        if not ar.wait(min(0.1, remaining())):
            todo.append(todo.pop(0))
            continue
        todo.pop(0)
        try:
            info = ar.get()
        except Exception as err:  # collected: every rank's failure is raised below, together
            failures.append((r, err))
            failed_at = failed_at or time.monotonic()
            continue
        r.device = info["device"]
    if failures:
        lines = []
        for r, e in sorted(failures, key=lambda f: f[0].rank):
            ename = getattr(e, "ename", type(e).__name__)
            evalue = getattr(e, "evalue", str(e))
            lines.append(f"  rank {r.rank} on {r.host}: {ename}: {evalue}")
        if late:
            who = describe_ranks(ranks, [r.rank for r in late])
            lines.append(f"  {who}: still waiting for the failed rank(s) in the rendezvous")
        msg = "the process group could not be created; nothing was left running.\n" + "\n".join(
            lines
        )
        raise ClusterError(msg)
    if late:
        who = describe_ranks(ranks, [r.rank for r in late])
        msg = (
            f"the process group was not ready within --timeout {options.timeout:g} s: {who} did not join "
            f"the rendezvous at {master_addr}:{port} (backend {plan.backend}). Nothing was left "
            "running. A firewall or a wrong network interface between the nodes is the usual cause."
        )
        raise ClusterError(msg)
    return plan


def rendezvous_port(session: Session) -> int:
    """A free port on rank 0's host for a new rendezvous (asked of rank 0 where it is elsewhere)."""
    if session.ranks[0].host == socket.gethostname():
        return free_local_port()
    return int(session.run(setup.free_port, ranks=[0], timeout=30)[0])


def check(
    session: Session, ranks: Sequence[int] | None = None, timeout: float = 10.0
) -> list[dict[str, Any]]:
    """Every rank's view of its group: initialized, and the sequence number of its collectives."""
    return session.run(setup.check_group, ranks=ranks, timeout=timeout)


def reinit(session: Session, timeout: float = 60.0) -> None:
    """Re-create the process group on every rank (after an interrupt broke it, or a restart)."""
    deadline = time.monotonic() + timeout
    master_addr = session.ranks[0].address
    # what TORCHELASTIC_RESTART_COUNT says on every rank from now on
    session.reinits += 1
    # planned again from the ranks' GPU counts: the same decision unless replaced engines differ
    session.plan = init_group(
        session.client,
        session.ranks,
        session.options,
        lambda: max(0.1, deadline - time.monotonic()),
        master_addr=master_addr,
        port=rendezvous_port(session),
        launcher=session.launcher,
        announce=False,
        run_id=session.cluster_id,
        restart_count=session.reinits,
    )
    session.backend = session.plan.backend
    if session.group_specs:
        # the named groups died with the old world group: the same names, on every rank again
        create_groups(session, session.group_specs, timeout=max(10.0, deadline - time.monotonic()))
    try:
        registry.write(session)  # the restart count, for a kernel that attaches later
    except Exception as e:
        log.warning(
            RECORD_FAILED, session.cluster_id, "re-init", type(e).__name__, e, exc_info=True
        )


def _named_groups_agree(info: list[dict[str, Any]]) -> bool:
    """Whether the members of every named group ran as many collectives in it (an interrupt can
    stop them at different points of one group while the world group stays in step)."""
    per_group: dict[str, set[Any]] = {}
    for i in info:
        for name, seq in (i.get("groups") or {}).items():
            per_group.setdefault(name, set()).add(seq)
    return all(None not in seqs and len(seqs) == 1 for seqs in per_group.values())


def repair(session: Session) -> str:
    """After an interrupt: keep the process group if every rank agrees on it, else re-create it."""
    try:
        info = check(session, timeout=10)
    except Exception:
        log.debug("the process group check failed: re-creating the group", exc_info=True)
        info = []
    seqs = [i.get("seq") for i in info]
    intact = (
        bool(info)
        and all(i.get("initialized") for i in info)
        and None not in seqs
        and len(set(seqs)) == 1
        and _named_groups_agree(info)
    )
    if intact:
        return "The process group is intact and every rank kept its variables."
    reinit(session)
    return (
        "The ranks stopped at different points of their collectives, so the process group was "
        "re-created; variables are kept, but rebuild objects that hold the old group (e.g. DDP models)."
    )


# ----------------------------------------------------------------------------- named sub-groups
def parse_groups(named: dict[str, Any], world_size: int) -> dict[str, list[int]]:
    """Group name -> its sorted world ranks, from rank specs as `--ranks` takes them (or lists)."""
    out: dict[str, list[int]] = {}
    for name, spec in named.items():
        if not isinstance(name, str) or not name.isidentifier():
            msg = f"group name {name!r}: use a Python identifier such as actor or rollout."
            raise ConfigError(msg)
        if spec is None or (isinstance(spec, str) and not spec.strip()):
            msg = f"group {name!r} names no ranks; give ranks such as 0-3, 0,2 or [0, 1]."
            raise ConfigError(msg)
        try:
            out[name] = parse_ranks(spec, world_size)
        except ConfigError as e:
            raise ConfigError(f"group {name}: {str(e).replace('--ranks ', '', 1)}") from None
    return out


def create_groups(session: Session, specs: dict[str, list[int]], timeout: float = 60.0) -> None:
    """Create `specs` on every rank, in one order (`new_group` is a collective of the whole world);
    the previous named groups are destroyed first."""
    session.run(engine_groups.define, list(specs.items()), timeout=timeout)


def define_groups(
    session: Session, named: dict[str, Any], timeout: float = 60.0
) -> dict[str, list[int]]:
    """Replace the named groups with `named` (name -> rank spec) on every rank; remembered here so a
    re-init re-creates them. Returns name -> world ranks."""
    specs = parse_groups(named, session.world_size)
    create_groups(session, specs, timeout=timeout)
    session.group_specs = specs
    try:
        registry.write(session)  # a kernel that attaches later knows them
    except Exception as e:
        log.warning(RECORD_FAILED, session.cluster_id, "groups", type(e).__name__, e, exc_info=True)
    return dict(specs)


def group_ranks(session: Session, name: str) -> list[int]:
    """The world ranks of group `name`; a `ConfigError` listing the defined groups if none is."""
    if name not in session.group_specs:
        if not session.group_specs:
            msg = (
                f"--group {name}: no groups are defined. Define them first: "
                f"%nbtrain groups {name}=0-1 (or cluster.groups({name}='0-1'))."
            )
        else:
            defined = ", ".join(f"{n} ({compact(r)})" for n, r in session.group_specs.items())
            msg = f"--group {name}: no such group. Defined: {defined}."
        raise ConfigError(msg)
    return list(session.group_specs[name])
