"""Engine-side fault plumbing: crash dumps into the engine's log, and the collective record for diagnosis.

The collective record is torch's flight recorder (gloo's, or ProcessGroupNCCL's own on a CUDA build),
read on demand by `collectives()` for `%nbtrain diagnose` and `--timeout`; the NCCL watchdog settings
it needs are set here before the group is created.

Runs inside each engine. The client reads the results with `apply` or the control channel; nothing here
imports widget or server code.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import MutableMapping
from typing import Any

log = logging.getLogger(__name__)

# torch's flight recorder keeps the last N collectives of every process group; it must be switched on
# before the group is created, and a ring of a few hundred small records costs nothing measurable
FR_BUFFER = "2000"
# set on every engine before its group exists, each only where the user has not set it (or its older
# name): torch reads them when it creates the process group
NCCL_DEFAULTS = {
    # the flight recorder, for gloo and NCCL (torch's FlightRecorder reads this name first, then the
    # old TORCH_NCCL_TRACE_BUFFER_SIZE: setting it over a user's old-name value would override theirs)
    "TORCH_FR_BUFFER_SIZE": FR_BUFFER,
    # when the NCCL watchdog times a collective out, write every rank's flight recorder to
    # TORCH_FR_DUMP_TEMP_FILE<rank> (older torch: TORCH_NCCL_DEBUG_INFO_TEMP_FILE; default
    # /tmp/nccl_trace_rank_<rank>) before the process goes
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    # 3 = SkipCleanUp, recent torch's own default, spelled out: on a timeout or NCCL error the
    # watchdog ends the process without ncclCommAbort, which can hang; 1 (abort, then end) loses the
    # flight-recorder dump (pytorch#121055, as torchtitan notes). The client then reports the rank's
    # death with its stderr (the watchdog's "Watchdog caught collective operation timeout:
    # WorkNCCL(SeqNum=...)") and %nbtrain restart replaces it
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
}
# older names torch still reads for the same setting: a user's value under either is kept
_ALIASES = {
    "TORCH_FR_BUFFER_SIZE": ("TORCH_NCCL_TRACE_BUFFER_SIZE",),
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": ("NCCL_ASYNC_ERROR_HANDLING",),
}
# pending NCCL entries whose call sites are looked up (each needs its stack symbolized)
MAX_SITES = 32
_STATE: dict[str, Any] = {}


def set_env_defaults(
    env: MutableMapping[str, str] | None = None, ours: dict[str, str] | None = None
) -> dict[str, str]:
    """Put `NCCL_DEFAULTS` into `env` (default os.environ) where the user set neither the name nor an alias.

    `ours` holds what earlier calls set (default: this engine's record), so a later call that finds a
    user's value arrived since (`start(env=...)` is applied by `init_rank`, after hello) takes ours
    back. Returns what is set by nbtrain now.
    """
    env = os.environ if env is None else env
    ours = _STATE.setdefault("env", {}) if ours is None else ours
    for name, value in NCCL_DEFAULTS.items():
        mine = name in ours and env.get(name) == ours[name]
        users = (name in env and not mine) or any(a in env for a in _ALIASES.get(name, ()))
        if users:
            if mine:
                del env[name]
            ours.pop(name, None)
            continue
        env[name] = value
        ours[name] = value
    return dict(ours)


def before_group() -> None:
    """Called by `setup.init_rank` just before it creates the process group (the user's env applied).

    Settles the environment defaults, and notes the time: flight-recorder entries older than this are
    from a group that was destroyed (a restart keeps the engine, and torch keeps one recorder per
    process), so a collective that group never finished is not reported as pending in the new one.
    """
    set_env_defaults()
    _STATE["group_since_ns"] = time.time_ns()


def log_fd() -> int | None:
    """The file descriptor of the engine's own log (its stderr before ipykernel captured it)."""
    err = sys.stderr
    fd = getattr(err, "_original_stdstream_copy", None)
    if isinstance(fd, int):
        return fd
    try:
        return sys.__stderr__.fileno() if sys.__stderr__ is not None else None
    except (OSError, ValueError):
        return None


def log_path() -> str | None:
    """Where the engine's log file is (the launcher's output file), if it is a file."""
    fd = log_fd()
    if fd is None:
        return None
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    return target if target.startswith("/") else None


def install() -> dict[str, Any]:
    """Make a dying engine leave a trace in its log: a Python stack on a fatal signal, its stderr lines.

    Also sets the NCCL watchdog and flight-recorder defaults, and the out-of-memory hook (`oom`).

    Idempotent; called from `setup.hello` on every engine.
    """
    if _STATE.get("installed"):
        return {"log": _STATE.get("log")}
    set_env_defaults()
    from nbtrain.engine import oom

    oom.install()
    fd = log_fd()
    if fd is not None:
        import faulthandler

        try:
            # a segfault or abort dumps every thread's Python stack where the client can read it
            faulthandler.enable(file=fd, all_threads=True)
        except (OSError, ValueError, RuntimeError):
            pass
        err = sys.stderr
        if hasattr(err, "echo") and getattr(err, "echo", None) is None:
            # tee the cell's stderr into the log: the client shows its tail when this rank dies, even
            # for ranks whose output the cell did not display
            try:
                err.echo = os.fdopen(os.dup(fd), "w", buffering=1)
            except OSError:
                pass
    _STATE["installed"] = True
    _STATE["log"] = log_path()
    return {"log": _STATE["log"]}


def _recorders(backend: str) -> list[tuple[str, Any]]:
    """torch's flight-recorder dumps to read for `backend`, best first.

    A CUDA build keeps two recorders: ProcessGroupNCCL's own (`_dump_nccl_trace`) and the generic one
    gloo writes to (`_dump_fr_trace`); a CPU build has only the second.
    """
    from torch._C import _distributed_c10d as c10d

    out = []
    if "nccl" in backend and hasattr(c10d, "_dump_nccl_trace"):
        out.append(("nccl", c10d._dump_nccl_trace))
    if hasattr(c10d, "_dump_fr_trace"):
        out.append(("generic", c10d._dump_fr_trace))
    return out


def is_cell_file(file: str) -> bool:
    """Whether a frame's file is a notebook cell's code (ipykernel's per-cell file names)."""
    return "ipykernel_" in file or "<ipython-input" in file


def _site(frames: list[dict[str, Any]] | None) -> str:
    """Where user code issued a recorded collective: the innermost frame outside torch and site-packages."""
    for f in frames or []:
        file = str(f.get("filename", ""))
        if "/site-packages/" in file or "/torch/" in file:
            continue
        short = "<cell>" if is_cell_file(file) else file
        return f"{short}:{f.get('line')} in {f.get('name')}"
    return ""


def is_pending(entry: dict[str, Any]) -> bool:
    """A recorded collective that has not completed: NCCL's state is scheduled or started (the GPU has
    not finished it); gloo's stays "scheduled", and its work is retired once it is done."""
    return not entry.get("retired") and entry.get("state") != "completed"


def summarize_entry(entry: dict[str, Any]) -> dict[str, Any]:
    """One flight-recorder entry as plain data: seq, op, state, process group, sizes, dtypes, site."""
    pg = entry.get("process_group") or ("", "")
    p2p = bool(entry.get("is_p2p"))
    return {
        "record_id": entry.get("record_id"),
        "seq": entry.get("p2p_seq_id") if p2p else entry.get("collective_seq_id"),
        "p2p": p2p,
        "op": str(entry.get("profiling_name", "")),
        "state": entry.get("state"),
        "pending": is_pending(entry),
        "pg": str(pg[0]),
        "pg_desc": str(pg[1]) if len(pg) > 1 else "",
        "sizes": entry.get("input_sizes") or [],
        "out_sizes": entry.get("output_sizes") or [],
        "dtypes": entry.get("input_dtypes") or [],
        "timeout_ms": entry.get("timeout_ms"),
        "site": _site(entry.get("frames")),
    }


def summarize_dump(
    dump: dict[str, Any], last: int = 8, pending: int = 8, since_ns: int = 0
) -> dict[str, Any]:
    """What diagnosis needs from a flight-recorder dump: the last entries, those not completed, pg status.

    Entries created before `since_ns` (wall-clock ns, as torch records them) are left out.
    """
    entries = [
        summarize_entry(e)
        for e in dump.get("entries", [])
        if int(e.get("time_created_ns") or 0) >= since_ns
    ]
    status = {
        str(pg): {k: v for k, v in s.items() if isinstance(v, int)}
        for pg, s in (dump.get("pg_status") or {}).items()
        if isinstance(s, dict)
    }
    # each process group's last collective, over the whole ring: sequence numbers count per group,
    # so diagnosis compares ranks group by group (a rank of one sub-group is not behind one of another)
    groups: dict[str, dict[str, Any]] = {}
    for e in entries:
        if not e["p2p"] and e["seq"] is not None:
            groups[e["pg"]] = {"seq": int(e["seq"]), "op": e["op"], "desc": e["pg_desc"]}
    return {
        "available": True,
        "entries": entries[-last:],
        "pending": [e for e in entries if e["pending"]][-pending:],
        "pg_status": status,
        "groups": groups,
    }


def _shape(sizes: Any) -> str:
    shapes = ["x".join(str(d) for d in s) if s else "scalar" for s in sizes or []]
    return ", ".join(shapes[:4]) + (f" (+{len(shapes) - 4})" if len(shapes) > 4 else "")


def describe_entry(e: dict[str, Any]) -> str:
    """'#3 nccl:all_reduce of 1024x1024 Float in pg 0 (default_pg), scheduled, issued at <cell>:5 in f'."""
    text = f"{'p2p ' if e.get('p2p') else ''}#{e.get('seq')} {e.get('op')}"
    if e.get("sizes"):
        dtypes = sorted(set(e.get("dtypes") or []))
        text += f" of {_shape(e['sizes'])}" + (f" {'/'.join(dtypes)}" if dtypes else "")
    pg = e.get("pg", "")
    text += f" in pg {pg}" + (f" ({e['pg_desc']})" if e.get("pg_desc") else "")
    text += f", {e.get('state')}"
    if e.get("site"):
        text += f", issued at {e['site']}"
    return text


def _add_sites(pending: list[dict[str, Any]], dump_fn: Any) -> None:
    """Where user code issued each pending NCCL collective, from a dump of the in-flight entries only.

    NCCL marks an entry done when its GPU work completes, so `onlyActive` keeps that dump (and its
    symbolizing) small; gloo never does, and a gloo rank's Python stack shows the call anyway.
    """
    import pickle

    try:
        raw = dump_fn(includeCollectives=True, includeStackTraces=True, onlyActive=True)
        sites = {e.get("record_id"): _site(e.get("frames")) for e in pickle.loads(raw)["entries"]}
    except Exception:  # the sizes and sequence numbers already say a lot
        return
    for e in pending:
        e["site"] = sites.get(e.get("record_id"), "") or e.get("site", "")


def collectives(last: int = 8) -> dict[str, Any]:
    """This rank's last collectives from torch's flight recorder, and those not completed yet.

    Each entry: seq, op ("nccl:all_reduce"), state, process group, input sizes and dtypes, and where user
    code issued it. For NCCL this is what shows a hung collective: the CPU only enqueues it, so the
    stacks show the rank later on (`loss.item()`, the next step), not in the collective. Empty when
    torch has no flight recorder or it was off when the group was made.
    """
    if "torch.distributed" not in sys.modules:
        return {"available": False, "entries": [], "pending": []}
    try:
        import pickle

        import torch.distributed as dist

        if not dist.is_initialized():
            return {"available": False, "entries": [], "pending": []}
        backend = str(dist.get_backend())
        recorders = _recorders(backend)
    except Exception as err:  # an old torch, or no recorder: the stacks alone still tell a lot
        return {"available": False, "entries": [], "pending": [], "error": repr(err)}
    errors = []
    found: dict[str, Any] | None = None
    for name, dump_fn in recorders:
        try:
            # without stack traces: symbolizing a full ring of 2000 entries took 3.7 s here, longer than
            # the client waits for a stack reply before it calls a rank silent
            raw = dump_fn(includeCollectives=True, includeStackTraces=False, onlyActive=False)
            out = summarize_dump(
                pickle.loads(raw), last=last, since_ns=int(_STATE.get("group_since_ns", 0))
            )
        except Exception as err:  # returned in the report: diagnose shows what it could not read
            errors.append(f"{name}: {err!r}")
            continue
        if name == "nccl" and 0 < len(out["pending"]) <= MAX_SITES:
            _add_sites(out["pending"], dump_fn)
        out["recorder"] = name
        out["backend"] = backend
        if out["entries"]:
            return out
        found = found or out
    if found is not None:
        return found
    return {"available": False, "entries": [], "pending": [], "error": "; ".join(errors)}


def tail_file(path: str, lines: int = 20, max_bytes: int = 64_000, start: int = 0) -> list[str]:
    """The last `lines` lines of a log file on this host, of what was written after byte `start`."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, start, size - max_bytes))
            data = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    return data.splitlines()[-lines:]
