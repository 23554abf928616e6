"""CUDA out of memory on a rank: say where, how much and what to change, then give the memory back.

Runs inside each engine. `install()` wraps the shell's `showtraceback`, which both a cell (execute) and
`Cluster.run` (apply) call when their code raises, so any code that runs out of GPU memory gets the
note, not only `finetune`, and the remote traceback is kept as it is. The client needs none of this
module but `parse` and `summary`, which are plain text functions (no torch).

Why the memory stays taken without it: the exception's traceback holds every frame the failed code
ran in, with their locals (activations, the batch, a model built inside a function), and IPython keeps
it in `sys.last_traceback`; the caching allocator then keeps the freed blocks for this process.
"""

from __future__ import annotations

import gc
import logging
import re
import socket
import sys
import traceback
from typing import Any

log = logging.getLogger(__name__)

# the note's first words: the client knows an annotated OOM by them, and the hook never adds it twice
MARK = "nbtrain: rank "
FIXES = (
    'To fit: a smaller per_device_train_batch_size (or per_device_train_batch_size="auto" to find '
    "the largest that fits) or max_length, or gradient_checkpointing=True."
)
_SIZE = r"[\d.]+ (?:bytes|KiB|MiB|GiB|TiB)"
_PATTERNS = {
    "alloc": re.compile(rf"Tried to allocate (?P<v>{_SIZE})"),
    "gpu": re.compile(r"GPU (?P<v>\d+) has a total capacity"),
    "total": re.compile(rf"total capacity of (?P<v>{_SIZE})"),
    "free": re.compile(rf"of which (?P<v>{_SIZE}) is free"),
    "in_use": re.compile(rf"this process has (?P<v>{_SIZE}) memory in use"),
    "by_torch": re.compile(rf"(?P<v>{_SIZE}) is allocated by PyTorch"),
    "reserved_free": re.compile(rf"(?P<v>{_SIZE}) is reserved by PyTorch but unallocated"),
}
_UNITS = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_STATE: dict[str, Any] = {}


def is_oom(ename: str, evalue: str) -> bool:
    """Whether a (remote) exception is CUDA running out of memory."""
    if ename == "OutOfMemoryError":
        return True
    # cudaMalloc outside the caching allocator (a new context, cuBLAS workspaces) raises RuntimeError
    return ename == "RuntimeError" and (
        "CUDA out of memory" in evalue or "CUDA error: out of memory" in evalue
    )


def parse(text: str) -> dict[str, str]:
    """The sizes in torch's OutOfMemoryError text: alloc, gpu, total, free, in_use, by_torch, reserved_free."""
    out = {}
    for key, pattern in _PATTERNS.items():
        m = pattern.search(text)
        if m:
            out[key] = m["v"]
    return out


def to_bytes(size: str) -> int:
    """'2.50 GiB' -> 2684354560."""
    value, unit = size.split()
    return int(float(value) * _UNITS[unit])


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def summary(evalue: str) -> str:
    """One line for a rank's OOM, from its message: 'tried to allocate 2.00 GiB; 1.20 GiB of 79.19 GiB free'."""
    sizes = parse(evalue)
    parts = []
    if "alloc" in sizes:
        parts.append(f"tried to allocate {sizes['alloc']}")
    if "free" in sizes and "total" in sizes:
        parts.append(f"{sizes['free']} of {sizes['total']} free")
    return "; ".join(parts) or "out of memory"


def _device_info() -> dict[str, Any]:
    """This rank's GPU as the driver sees it now (torch.cuda.mem_get_info), if CUDA is in use."""
    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    try:
        if not torch.cuda.is_initialized():
            return {}
        dev = torch.cuda.current_device()
        free, total = torch.cuda.mem_get_info(dev)
        return {
            "device": f"cuda:{dev}",
            "name": torch.cuda.get_device_name(dev),
            "free": free,
            "total": total,
            "allocated": torch.cuda.memory_allocated(dev),
            "reserved": torch.cuda.memory_reserved(dev),
        }
    except Exception:  # a broken context must not hide the error being reported
        return {}


def explain(evalue: str, now: dict[str, Any] | None = None) -> str:
    """The note added under torch's message: where, how much, and what to change."""
    import os

    now = _device_info() if now is None else now
    sizes = parse(evalue)
    rank = os.environ.get("RANK", "?")
    where = f"{MARK}{rank} on {socket.gethostname()}"
    if now.get("device"):
        where += f" ({now['device']}, {now['name']})"
    lines = []
    what = f"{where} ran out of GPU memory"
    if "alloc" in sizes:
        what += f": it tried to allocate {sizes['alloc']}"
        if "free" in sizes and "total" in sizes:
            what += f" with {sizes['free']} of {sizes['total']} free"
    lines.append(what + ".")
    if now.get("total"):
        lines.append(
            f"At the failure torch.cuda.mem_get_info said {gib(now['free'])} of {gib(now['total'])} free; "
            f"this rank's tensors held {gib(now['allocated'])} (reserved by torch: {gib(now['reserved'])})."
        )
    lines.append(FIXES)
    return "\n".join(lines)


def _chain(err: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    e: BaseException | None = err
    while e is not None and e not in seen and len(seen) < 16:
        seen.append(e)
        e = e.__cause__ or e.__context__
    return seen


def release(err: BaseException) -> dict[str, Any]:
    """Drop what the failed code still holds on the GPU: its frames' locals, then torch's cached blocks.

    Returns the device's memory afterwards ({} without CUDA). Frames that still run (the engine's own)
    are left alone; a cell's globals are the user's and are kept.
    """
    for e in _chain(err):
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
    # IPython's post-mortem references (%debug reads them); the engine has no debugger attached
    sys.last_type = sys.last_value = sys.last_traceback = None  # type: ignore[assignment]
    if hasattr(sys, "last_exc"):
        sys.last_exc = None  # type: ignore[attr-defined]
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                torch.cuda.empty_cache()
        except Exception:
            log.debug("torch.cuda.empty_cache() failed after an out-of-memory error", exc_info=True)
    return _device_info()


def _annotate(err: BaseException) -> None:
    text = str(err)
    if MARK in text:
        return
    err.args = (f"{text}\n\n{explain(text)}",)


def _released_note(err: BaseException) -> None:
    after = release(err)
    if after.get("total"):
        note = (
            f"nbtrain released the failed code's tensors and torch's cached blocks ({gib(after['free'])} "
            f"of {gib(after['total'])} free while the error was reported; the rest is freed when the "
            "cell ends), so the next cell runs without a restart."
        )
    else:
        note = (
            "nbtrain released the failed code's tensors, so the next cell runs without a restart."
        )
    err.args = (f"{err}\n{note}",)


def install() -> None:
    """Annotate and clean up after an OOM in any cell or `Cluster.run` call on this engine. Idempotent."""
    if _STATE.get("installed"):
        return
    try:
        from IPython import get_ipython
    except ImportError:
        return
    ip = get_ipython()
    if ip is None:
        return
    original = ip.showtraceback

    def showtraceback(exc_tuple: Any = None, *args: Any, **kwargs: Any) -> Any:
        etype, value, _tb = exc_tuple if exc_tuple is not None else sys.exc_info()
        oom = isinstance(value, BaseException) and is_oom(
            getattr(etype, "__name__", ""), str(value)
        )
        if oom:
            try:
                _annotate(value)  # type: ignore[arg-type]
            except Exception:
                # torch's own message is shown, without nbtrain's note on it
                log.debug("annotating an out-of-memory error failed", exc_info=True)
                oom = False
        result = original(exc_tuple, *args, **kwargs)
        if oom:
            # after the traceback is formatted (it reads the frames), before the reply is sent: the
            # reply's evalue is str(err), read after this returns
            try:
                _released_note(value)  # type: ignore[arg-type]
            except Exception:
                log.debug("the note on released memory failed", exc_info=True)
            # inside a cell IPython is still handling the exception here; on an H100 only 2 of 79 GiB
            # were back at this point: release once more when the cell is over
            _STATE["pending"] = value
        return result

    def post_run_cell(*_: Any) -> None:
        err = _STATE.pop("pending", None)
        if err is not None:
            try:
                release(err)
            except Exception:
                log.debug("releasing an out-of-memory error's memory failed", exc_info=True)

    ip.showtraceback = showtraceback
    ip.events.register("post_run_cell", post_run_cell)
    _STATE["installed"] = True
