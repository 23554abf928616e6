"""Preemption: SIGTERM or SIGUSR1 while `finetune` runs means a checkpoint at the next step's end.

Shared clusters preempt: Slurm sends SIGTERM (or the signal `--signal=USR1@90` asks for) and kills
the job after a grace period; spot instances and Kubernetes evictions do the same. While a run is in
its loop, `Preemption` catches those signals on every rank and only records them: every rank
finishes the step it is in, the step's small all-reduce tells all of them, one checkpoint is written
for that step (atomically, as for `save_steps`), and every rank raises `Preempted`.

Outside `finetune` the process keeps the handlers it had: they are put back when the run ends. A
second signal changes nothing (the checkpoint under way is either written whole or not at all).
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from nbtrain.errors import NbtrainError

log = logging.getLogger(__name__)

#: the signals a run turns into a checkpoint
SIGNALS = ("SIGTERM", "SIGUSR1")


class Preempted(NbtrainError):
    """A run stopped by a preemption signal, after writing a checkpoint for the step it reached."""


class Preemption:
    """Record SIGTERM/SIGUSR1 for the length of a `with` block (main thread only; elsewhere a no-op).

    `signum` is the first signal received, 0 before any."""

    def __init__(self) -> None:
        self.signum = 0
        self._old: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        if not self.signum:
            self.signum = signum

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            for name in SIGNALS:
                sig = getattr(signal, name, None)
                if sig is not None:
                    self._old[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
        self._old.clear()


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def message(
    step: int,
    total: int,
    rank: int,
    host: str,
    signum: int,
    checkpoint: str,
    config: str = "SFTConfig",
) -> str:
    """What every rank raises: where the signal landed, the checkpoint, and the code that resumes
    (`config`: the name of the run's config class, SFTConfig, DPOConfig or GRPOConfig)."""
    return (
        f"preempted at step {step}/{total} on rank {rank} ({host}, {signal_name(signum)}); "
        f"checkpoint at {checkpoint}; resume with "
        "nbtrain.finetune(dataclasses.replace(cfg, resume='latest')) where cfg is this run's "
        f"{config} (or the same {config}(...) with resume='latest')"
    )
