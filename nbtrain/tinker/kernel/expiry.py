"""Sessions whose client went away: a session with no heartbeat and no request for longer than
`session_timeout` seconds (the SDK heartbeats every 10 s) is ended, so a notebook or a recipe that
died does not hold its LoRA models and optimizer state on the ranks for ever.

Each of its models is first saved as a named training checkpoint, exactly as `save_state` saves one,
`tinker://<model_id>/weights/expired-<time>`, then unloaded; a later request for the model or the
session is a 404 that names that path, and `load_weights` (`create_training_client_from_state`) from
it resumes. A model whose save fails stays on the ranks (nothing is lost) and is served again.
The check runs on a timer of the server's own loop (`TinkerService`), not a thread per session.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any

from nbtrain.errors import ConfigError
from nbtrain.tinker.kernel import protocol as proto
from nbtrain.tinker.kernel.backend import Backend
from nbtrain.tinker.kernel.futures import Executor, Payload

log = logging.getLogger(__name__)

#: a session idle this long (seconds) is ended; 0: never
SESSION_TIMEOUT_S = 600.0


def check_timeout(value: Any) -> float:
    """`session_timeout` as seconds, checked where it enters."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        msg = (
            f"session_timeout={value!r} must be a number of seconds >= 0 (0: sessions never "
            f"expire; the default is {SESSION_TIMEOUT_S:g})."
        )
        raise ConfigError(msg)
    return float(value)


class Expiry:
    """The expiry half of `Verbs` (which holds the state these methods use)."""

    backend: Backend
    executor: Executor
    models: dict[str, Any]
    sessions: dict[str, Any]
    root: Path
    _lock: threading.Lock
    session_timeout: float = SESSION_TIMEOUT_S
    #: model id -> why it is gone and where its state is (what a later request for it is told)
    expired: dict[str, str]

    def check_every(self) -> float:
        """How often the server's loop looks for idle sessions."""
        return min(30.0, max(0.2, self.session_timeout / 4)) if self.session_timeout else 30.0

    def touch(self, s: Any) -> None:
        """A request of session `s` (or one of its models) came: it is alive."""
        if s is not None and s.finished is None:
            s.heartbeat = time.time()

    def seen(self, model_id: Any) -> None:
        """A request about `model_id` (a future's poll): its session is alive."""
        m = self.models.get(model_id) if isinstance(model_id, str) else None
        if m is not None:
            self.touch(self.sessions.get(m.session_id))

    def expire_idle(self, now: float | None = None) -> list[str]:
        """End every session idle longer than `session_timeout`; the ids of those ended."""
        if not self.session_timeout:
            return []
        now = time.time() if now is None else now
        ended = []
        for s in list(self.sessions.values()):
            idle = now - s.heartbeat
            if s.finished is None and idle > self.session_timeout:
                self._expire(s, idle)
                ended.append(s.session_id)
        return ended

    def _expire(self, s: Any, idle: float) -> None:
        why = (
            f"session {s.session_id} expired: no heartbeat or request for {idle:.0f} s "
            f"(the service's session_timeout is {self.session_timeout:g} s)"
        )
        name = time.strftime("expired-%Y%m%d-%H%M%S")
        with self._lock:
            s.finished = "expired"
            saved = {}
            for m in [m for m in self.models.values() if m.session_id == s.session_id]:
                path = proto.tinker_path(m.model_id, "weights", name)
                saved[m.model_id] = path
                self.expired[m.model_id] = (
                    f"model {m.model_id} was unloaded because its {why}; its state (adapter and "
                    f"optimizer) was saved to {path}: load_weights from that path "
                    "(create_training_client_from_state) resumes it."
                )
                self.executor.submit(f"expire {m.model_id}", self._expirer(m, name, path))
        s.expired = why + (
            "; its models' state was saved to " + ", ".join(saved.values()) + "."
            if saved
            else "; it held no models."
        )

    def _expirer(self, m: Any, name: str, path: str) -> Any:
        def run() -> Payload:
            said = f"nbtrain: Tinker {self.expired.get(m.model_id, '')}"
            if m.info is not None:  # created (or still failed): a model the ranks hold
                folder = proto.local_folder(self.root, m.model_id, "weights", name)
                try:
                    folder.parent.mkdir(parents=True, exist_ok=True)
                    self.backend.save_state(m.model_id, str(folder), True)
                except Exception as e:  # noqa: BLE001 - the model stays; nothing is lost
                    self.expired.pop(m.model_id, None)
                    print(
                        f"nbtrain: the Tinker service could not save {m.model_id} of an expired "
                        f"session ({type(e).__name__}: {e}); it stays on the ranks and is served "
                        "again. Save it with save_state, or stop the service.",
                        file=sys.stderr,
                    )
                    raise
                m.last_state = path
                said += f" (folder {folder})"
                self.backend.unload(m.model_id)
            else:
                said = f"nbtrain: Tinker model {m.model_id} was never created; its session expired."
                self.expired[m.model_id] = said[len("nbtrain: Tinker ") :]
            if m.run is not None:
                m.run.finish("stopped")
            with self._lock:
                self.models.pop(m.model_id, None)
            self.executor.forget(m.model_id)
            print(said, file=sys.stderr)
            return ("json", {"type": "expire", "model_id": m.model_id, "path": path})

        return run
