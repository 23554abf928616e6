"""A preemption notice (SIGTERM, or the SIGUSR1 Slurm's `--signal=USR1@90` sends) while the Tinker
service holds models: every live model's state is written, at once, before the grace period ends.

In [1]: cluster.run(service.arm_preemption, "/runs/tinker/preempted")     # every rank
  ...   # later, on a notice: rank 0 has written /runs/tinker/preempted/<model_id>/ for each model
In [2]: cluster.run(service.preemption_status)   # [{"signal": "SIGUSR1", "saved": [...]}, ...]

The service's engines sit idle between requests, so no training loop would see a flag: the handler
itself writes the checkpoints. SIGTERM then goes on to the handler the engine had (it still stops);
SIGUSR1 is only a notice, and the engine serves on. Every rank holds the same weights and optimizer state, so rank 0 writes
them alone, with no collective that a peer already gone could hang. A notice that arrives inside
`forward_backward` or `optim_step` (`guarded`) is held until the call ends, so no half-updated
weights are saved; one that arrives between calls writes at once. The other ranks record the signal
and write nothing. Saving is atomic (`state.write_state`): each folder is old or new, never half.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from nbtrain import procs
from nbtrain.engine.rank import get_rank
from nbtrain.engine.signals.preempt import SIGNALS, signal_name
from nbtrain.tinker.ranks import registry, state

log = logging.getLogger(__name__)

_armed: dict[str, Any] = {"folder": None, "old": {}, "signum": 0, "saved": [], "errors": []}
_busy = [0]


def arm_preemption(folder: str) -> bool:
    """Checkpoint every live model under `folder` on SIGTERM/SIGUSR1 (see the module's doc). Returns
    False where signals cannot be caught (not the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    _armed.update(folder=str(folder), signum=0, saved=[], errors=[])
    for name in SIGNALS:
        sig = getattr(signal, name, None)
        if sig is not None and sig not in _armed["old"]:
            _armed["old"][sig] = signal.signal(sig, _on_signal)
    return True


def disarm_preemption() -> None:
    """Put back the handlers the process had before `arm_preemption`."""
    for sig, old in _armed["old"].items():
        signal.signal(sig, old if old is not None else signal.SIG_DFL)
    _armed.update(folder=None, old={})


def preemption_status() -> dict[str, Any]:
    """{"signal": the notice's name or None, "saved": folders written, "errors": what failed}."""
    signum = _armed["signum"]
    return {
        "signal": signal_name(signum) if signum else None,
        "saved": list(_armed["saved"]),
        "errors": list(_armed["errors"]),
    }


def _on_signal(signum: int, frame: Any) -> None:
    if not _armed["signum"]:  # a second notice writes nothing more
        _armed["signum"] = signum
        if not _busy[0]:
            _checkpoint()
    if signum == getattr(signal, "SIGTERM", None):
        # SIGTERM still ends the engine as it did (its stop, or the end of a grace period), after
        # the checkpoint; SIGUSR1 is only a notice
        old = _armed["old"].get(signum)
        if callable(old):
            old(signum, frame)
        elif old != signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            procs.signal_process(os.getpid(), signum)


def _checkpoint() -> None:
    folder = _armed["folder"]
    if folder is None or get_rank() != 0:
        return
    for model_id, trainee in sorted(registry.MODELS.items()):
        path = state.checkpoint_folder(folder, model_id)
        try:
            _armed["saved"].append(state.write_state(trainee, path, optimizer=True))
        except Exception as e:  # the next model may still be saved
            _armed["errors"].append(f"{model_id}: {type(e).__name__}: {e}")
            print(f"nbtrain: preemption checkpoint of {model_id!r} failed: {e}", file=sys.stderr)


@contextlib.contextmanager
def guarded() -> Iterator[None]:
    """Hold a notice's checkpoint until the weights and optimizer state are whole again."""
    _busy[0] += 1
    try:
        yield
    finally:
        _busy[0] -= 1
        if not _busy[0] and _armed["signum"] and not _armed["saved"] and not _armed["errors"]:
            _checkpoint()
