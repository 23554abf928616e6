"""Engine-side fault plumbing: crash dumps into the engine's log, and the collective record for diagnosis.

Runs inside each engine. The client reads the results with `apply` or the control channel; nothing here
imports widget or server code.
"""

from __future__ import annotations

import os
import sys
from typing import Any

# torch's flight recorder keeps the last N collectives of every process group; it must be switched on
# before the group is created, and a ring of a few hundred small records costs nothing measurable
FR_BUFFER = "2000"
_STATE: dict[str, Any] = {}


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

    Also installs the out-of-memory hook (`oom`).

    Idempotent; called from `setup.hello` on every engine.
    """
    if _STATE.get("installed"):
        return {"log": _STATE.get("log")}
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", FR_BUFFER)
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


def collectives(last: int = 8) -> dict[str, Any]:
    """This rank's last collectives from torch's flight recorder: sequence number, op, state.

    Empty when torch has no flight recorder or it was not on when the group was made.
    """
    if "torch.distributed" not in sys.modules:
        return {"available": False, "entries": []}
    try:
        import pickle

        import torch.distributed as dist
        from torch._C import _distributed_c10d as c10d

        if not dist.is_initialized():
            return {"available": False, "entries": []}
        dump = pickle.loads(c10d._dump_fr_trace())  # type: ignore[attr-defined]
    except Exception as err:  # an old torch, or no recorder: the stacks alone still tell a lot
        return {"available": False, "entries": [], "error": repr(err)}
    entries = []
    for entry in dump.get("entries", [])[-last:]:
        pg = entry.get("process_group")
        entries.append(
            {
                "seq": entry.get("collective_seq_id"),
                "op": str(entry.get("profiling_name", "")),
                "state": entry.get("state"),
                "pg": str(pg[0]) if pg else "",
            }
        )
    return {"available": True, "entries": entries}


def tail_file(path: str, lines: int = 20, max_bytes: int = 64_000) -> list[str]:
    """The last `lines` lines of a log file on this host."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    return data.splitlines()[-lines:]
