"""Processes: the one module that finds, signals or kills them, on this machine or over SSH.

Every teardown path (a stopped cluster, a failed start, a stuck rank, the idle watchdog, a restart)
calls these, and so does every other signal or kill of a process: the vLLM process and the Ray
actor's engine (`stop`, `signal_process`), the preemption notice passed on to the default handler,
srun after a timeout, an engine signalled through ipyparallel (`signal_engine`); none carries its
own copy. A bottom module beside `nbtrain.atomic`: it imports only the standard library (psutil
inside its functions, and in the script it runs over SSH), so the rank runtime and the training
layers may use it as the kernel side does; an ipyparallel client is only ever passed in. Remote pids
are only ever signalled on their own host (here they may be anyone's).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

log = logging.getLogger(__name__)


# -- finding -----------------------------------------------------------------------------------


def running(proc: Any) -> bool:
    """A psutil process that has not exited (a zombie has: only its reaping is left)."""
    import psutil

    try:
        # our own children linger as zombies until ipyparallel's waiter threads reap them: they are gone
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def alive(pid: Any) -> bool:
    """True if process `pid` runs on this machine (not a zombie); False for junk input."""
    import psutil

    try:
        return psutil.Process(int(pid)).status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, TypeError, ValueError):
        return False


def gone(pid: int) -> bool:
    """True if process `pid` has exited (or is a zombie); False when psutil cannot tell."""
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


def exists(pid: int) -> bool:
    """True if some process has id `pid` on this machine."""
    import psutil

    return bool(psutil.pid_exists(pid))


def descendants(pids: Sequence[int]) -> list[int]:
    """Every child, grandchild, ... of `pids` that still runs."""
    import psutil

    out: list[int] = []
    for pid in pids:
        try:
            out.extend(p.pid for p in psutil.Process(pid).children(recursive=True))
        except psutil.Error:
            continue
    return out


def using(path: str) -> list[int]:
    """Every process of this user here (not this one) whose command line names `path` or that has
    a file under it open: a private Ray's processes all do (its temp dir), even the agents that
    rename themselves and outlive their parent."""
    import psutil

    uid, me, out = os.getuid(), os.getpid(), []
    for p in psutil.process_iter(["pid", "cmdline", "uids"]):
        try:
            if p.info["pid"] == me or (p.info["uids"] and p.info["uids"].real != uid):
                continue
            if path in " ".join(p.info["cmdline"] or []) or any(
                f.path.startswith(path) for f in p.open_files()
            ):
                out.append(p.info["pid"])
        except psutil.Error:
            continue
    return out


def launcher_pids(ipp_cluster: Any) -> list[int]:
    """The controller's pid and every engine launcher's pid that ipyparallel started here."""
    pids = controller_pids(ipp_cluster)
    for engine_set in getattr(ipp_cluster, "engines", {}).values():
        for launcher in getattr(engine_set, "launchers", {}).values():
            if getattr(launcher, "pid", None):
                pids.append(int(launcher.pid))
    return pids


def controller_pids(ipp_cluster: Any) -> list[int]:
    """The controller's pid here, if ipyparallel started one."""
    ctl = getattr(ipp_cluster, "controller", None) if ipp_cluster is not None else None
    return [int(ctl.pid)] if ctl is not None and getattr(ctl, "pid", None) else []


def session_groups(pids: Sequence[int]) -> list[int]:
    """The process groups `pids` lead: ipyparallel starts the controller (and each local engine) in a
    session of its own, so its group also holds what it spawns, even once orphaned."""
    mine = os.getpgid(0)
    groups = []
    for pid in dict.fromkeys(pids):
        try:
            if os.getpgid(pid) == pid != mine:
                groups.append(pid)
        except OSError:
            continue
    return groups


# -- signalling and killing ----------------------------------------------------------------------


def signal_process(proc: Any, sig: int) -> bool:
    """Send `sig` to one process on this machine: a pid, a `subprocess.Popen` or a `psutil.Process`.
    False when it has exited already (a Popen already reaped, no such pid): nothing to signal."""
    if isinstance(proc, subprocess.Popen):
        if proc.poll() is not None:
            return False
        proc.send_signal(sig)  # a Popen knows whether its pid is still its child's
        return True
    if isinstance(proc, int):
        try:
            os.kill(proc, sig)
        except ProcessLookupError:
            return False
        return True
    import psutil

    try:
        proc.send_signal(sig)
    except psutil.NoSuchProcess:
        return False
    return True


def interrupt(pid: int) -> None:
    """SIGINT to `pid` here (a KeyboardInterrupt in whatever it runs); gone already is fine."""
    signal_process(pid, signal.SIGINT)


def stop(proc: subprocess.Popen[Any], grace: float = 5.0, kill_wait: float = 5.0) -> int | None:
    """End a child process this process started: SIGTERM, up to `grace` seconds to exit, then
    SIGKILL and up to `kill_wait` seconds to be reaped (`grace=0`: SIGKILL at once). Its exit code,
    or None if it could not be reaped even then."""
    if proc.poll() is None and grace > 0:
        signal_process(proc, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:
        signal_process(proc, signal.SIGKILL)
        try:
            proc.wait(kill_wait)
        except subprocess.TimeoutExpired:
            pass
    return proc.returncode


def signal_engine(client: Any, sig: int, engine_id: int) -> None:
    """Ask ipyparallel to send `sig` to engine `engine_id` (an ipyparallel `Client`): its nanny on the
    engine's host delivers it, for an engine whose pid is on another machine. Not blocking; the
    client's errors (a controller that is gone) propagate."""
    client.send_signal(sig, targets=[engine_id], block=False)


def kill_with_children(pids: Sequence[int]) -> list[int]:
    """SIGKILL `pids` here at once, and their children; returns the children's pids (they may
    take a moment to exit: `kill_tree` them to wait)."""
    import psutil

    kids: list[int] = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            children = proc.children(recursive=True)
            proc.kill()
            for k in children:
                try:
                    k.kill()
                except psutil.Error:
                    pass
            kids.extend(k.pid for k in children)
        except psutil.Error:
            pass
    return kids


def kill_tree(pids: Sequence[int], grace: float = 3.0) -> None:
    """Wait for processes (and their children) to exit, then kill what is left."""
    import psutil

    procs: list[psutil.Process] = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs.append(p)
            procs.extend(p.children(recursive=True))
        except psutil.Error:
            continue
    if not procs:
        return
    _, left = psutil.wait_procs(procs, timeout=grace)
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=2.0)


def terminate(pids: Sequence[int], grace: float) -> None:
    """SIGTERM every process, SIGKILL those still running after `grace` seconds."""
    import psutil

    procs = []
    for pid in dict.fromkeys(pids):
        try:
            p = psutil.Process(pid)
            p.terminate()
            procs.append(p)
        except psutil.Error:
            continue
    deadline = time.monotonic() + grace
    while procs and time.monotonic() < deadline:
        time.sleep(0.05)
        procs = [p for p in procs if running(p)]
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


def kill_groups(groups: Sequence[int]) -> None:
    """SIGKILL whatever is left in `groups`: a controller stopped while it was still starting has
    spawned its schedulers after anyone could list its children, and they outlive it."""
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except OSError:
            continue  # the group is empty: everything in it has exited


# -- on other hosts, over SSH --------------------------------------------------------------------

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


def kill_on_hosts(
    ssh: Sequence[str],
    remote_python: str,
    pids: dict[str, set[int]],
    files: dict[str, set[str]],
) -> None:
    """On each host (one `ssh` command line each, all at once): TERM the pids and their children,
    KILL survivors, remove `files`. `ssh` is the ssh command and its options, without the host."""

    def one(location: str) -> None:
        cmd = (
            f"{shlex.quote(remote_python)} -c {shlex.quote(_KILL_LEFT)} "
            f"{shlex.quote(json.dumps(sorted(pids.get(location, ()))))} "
            f"{shlex.quote(json.dumps(sorted(files.get(location, ()))))}"
        )
        try:
            proc = subprocess.run(
                [*ssh, location, cmd],
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


def exit_code(proc: Any, wait: float = 1.0, waiter: Any = None) -> int | None:
    """The exit status of psutil process `proc` (our child; psutil caches it once reaped), waiting
    up to `wait` seconds; None when it is unknown. `waiter`: a thread that already waits on `proc`
    (ipyparallel's launchers have one): its wait reaps the process, so we wait for that thread and
    read what psutil cached, instead of racing it (the loser's None would be what psutil keeps)."""
    import psutil

    deadline = time.monotonic() + wait
    if waiter is not None and waiter.is_alive():
        waiter.join(wait)
        if waiter.is_alive():
            return None  # still running, or not reaped within `wait`
    while True:
        try:
            code = proc.wait(timeout=0)
            return code if code is not None else None
        except psutil.TimeoutExpired:
            if time.monotonic() > deadline:
                return None
            time.sleep(0.02)
        except psutil.Error:
            return None
