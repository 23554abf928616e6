"""`TinkerService`: the HTTP server in a thread of this kernel, over a backend on the cluster's
ranks (or in this kernel), and `tinker_url()`, the URL of the one running now.

In [1]: svc = nbtrain.current_cluster().serve_tinker()      # or %nbtrain serve tinker
In [2]: import tinker; sc = tinker.ServiceClient(base_url=svc.url)
"""

from __future__ import annotations

import asyncio
import atexit
import ipaddress
import logging
import os
import secrets
import socket
import sys
import threading
from pathlib import Path
from typing import Any

from nbtrain.errors import ConfigError
from nbtrain.tinker.kernel.backend import Backend, ClusterBackend, InProcessBackend
from nbtrain.tinker.kernel.expiry import SESSION_TIMEOUT_S
from nbtrain.tinker.kernel.verbs import Verbs

log = logging.getLogger(__name__)

_current: TinkerService | None = None
#: the environment variables serve_tinker set in this kernel (and may set again)
_ENV_SET: dict[str, str] = {}


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_key(host: str, api_key: str | None) -> None:
    """Beyond the loopback a key is required; a key has the SDK's shape (it starts with tml-)."""
    if api_key is not None and (
        not isinstance(api_key, str) or not api_key.startswith("tml-") or len(api_key) < 12
    ):
        msg = (
            f"api_key {api_key!r} does not have the tinker SDK's shape: it must start with 'tml-' "
            "and be at least 12 characters, e.g. 'tml-' + secrets.token_hex(16)."
        )
        raise ConfigError(msg)
    if api_key is None and not _loopback(host):
        msg = (
            f"serving on {host} exposes the cluster beyond this machine; give an api_key "
            "(serve_tinker(host=..., api_key='tml-...'), or %nbtrain serve tinker --host H --api-key "
            "tml-...), which every request must then send as X-API-Key (TINKER_API_KEY)."
        )
        raise ConfigError(msg)


class TinkerService:
    """A Tinker-compatible service: `.url`, `.api_key`, `.status()`, `.reload()`, `.stop()`.

    A session with no heartbeat or request for `session_timeout` seconds (0: never) is ended: its
    models are saved, then unloaded (`nbtrain.tinker.kernel.expiry`)."""

    def __init__(
        self,
        backend: Backend,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        root: str | os.PathLike[str] | None = None,
        cluster_id: str | None = None,
        world: int = 1,
        session_timeout: float = SESSION_TIMEOUT_S,
    ):
        import tornado.httpserver
        import tornado.netutil
        import tornado.web

        from nbtrain.tinker.kernel import wire
        from nbtrain.tinker.kernel.handlers import routes

        check_key(host, api_key)
        from nbtrain.tinker.kernel.expiry import check_timeout

        check_timeout(session_timeout)
        wire.pb()  # the SDK's messages: a clear ImportError now, not a 400 per request later
        from nbtrain.runs import nbtrain_home

        self.root = Path(root) if root is not None else nbtrain_home() / "tinker"
        self.root.mkdir(parents=True, exist_ok=True)
        self.host = host
        #: enforced on every request when given (or when bound beyond the loopback)
        self.checked = api_key is not None
        self.api_key = api_key or f"tml-nbtrain-{secrets.token_hex(12)}"
        self.backend = backend
        self.verbs = Verbs(
            backend, self.root, cluster_id=cluster_id, world=world, session_timeout=session_timeout
        )
        # no access log: a training loop makes thousands of requests, and refusals are the client's to show
        app = tornado.web.Application(
            routes(self.verbs, api_key), log_function=lambda handler: None
        )
        sockets = tornado.netutil.bind_sockets(port, address=host, family=socket.AF_UNSPEC)
        self.port = sockets[0].getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self.stopped = False
        self._timer: asyncio.TimerHandle | None = None
        started = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(self._loop)
            self._server = tornado.httpserver.HTTPServer(
                app, max_body_size=1 << 30, idle_connection_timeout=300
            )
            self._server.add_sockets(sockets)
            self._rearm()
            started.set()
            self._loop.run_forever()
            self._loop.close()

        self._thread = threading.Thread(
            target=serve, name=f"nbtrain-tinker-{self.port}", daemon=True
        )
        self._thread.start()
        started.wait(10)

    def _expire_idle(self) -> None:
        # on the server's loop, between requests: one timer for every session
        try:
            self.verbs.expire_idle()
        except Exception as e:  # the service serves on; the next tick tries again
            log.warning("nbtrain: the Tinker service's session expiry failed: %s", e, exc_info=True)
        self._rearm()

    def _rearm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if not self.stopped:
            self._timer = self._loop.call_later(self.verbs.check_every(), self._expire_idle)

    @property
    def session_timeout(self) -> float:
        """Seconds without a heartbeat or request after which a session ends (0: never); settable."""
        return self.verbs.session_timeout

    @session_timeout.setter
    def session_timeout(self, seconds: float) -> None:
        from nbtrain.tinker.kernel.expiry import check_timeout

        self.verbs.session_timeout = check_timeout(seconds)
        self._loop.call_soon_threadsafe(self._rearm)  # the next check at the new pace

    @property
    def url(self) -> str:
        """The base_url to give tinker.ServiceClient (or TINKER_BASE_URL)."""
        host = self.host
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostname()
        elif ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    def __repr__(self) -> str:
        state = "stopped" if self.stopped else "serving"
        return f"<nbtrain TinkerService {state} at {self.url} {self.backend.where}, folder {self.root}>"

    def status(self, timeout: float = 60.0) -> list[dict[str, Any]]:
        """Every live model on the ranks: model_id, base_model, lora_rank, steps, memory_bytes;
        asked after the requests already queued, waiting at most `timeout` s."""
        return self.verbs.status(timeout)

    @property
    def preemption_folder(self) -> Path | None:
        """Where a preemption notice (SIGTERM, Slurm's SIGUSR1) writes every live model's state, one
        folder each; None where it is not armed (the service was started off the main thread)."""
        return self.verbs.preempted if self.verbs.armed else None

    def reload(self) -> list[str]:
        """After `%nbtrain restart`: every model back from its last saved state; what was done."""
        return self.verbs.reload()

    def stop(self) -> None:
        """Stop serving; pending requests fail, models are left on the ranks until unloaded."""
        global _current
        if self.stopped:
            return
        self.stopped = True
        self.verbs.close()
        if self.verbs.armed:
            try:
                self.backend.disarm()
            except Exception:  # noqa: BLE001 - the old handlers are a courtesy, the stop goes on
                pass

        def halt() -> None:
            self._server.stop()
            self._loop.stop()

        self._loop.call_soon_threadsafe(halt)
        self._thread.join(timeout=10)
        if _current is self:
            _current = None
            # only the exported service unexports: a TinkerService made directly and stopped
            # leaves the running service's TINKER_BASE_URL / TINKER_API_KEY alone
            for name, value in list(_ENV_SET.items()):
                if os.environ.get(name) == value:
                    del os.environ[name]
                del _ENV_SET[name]


def _export(service: TinkerService) -> None:
    # `tinker.ServiceClient()` in this kernel then finds the service with no arguments; a value the
    # user set themselves is kept
    for name, value in (("TINKER_BASE_URL", service.url), ("TINKER_API_KEY", service.api_key)):
        if name not in os.environ or _ENV_SET.get(name) == os.environ[name]:
            os.environ[name] = value
            _ENV_SET[name] = value


def serve(
    session: Any = None,
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str | None = None,
    root: str | os.PathLike[str] | None = None,
    watch: Any = None,
    session_timeout: float = SESSION_TIMEOUT_S,
) -> TinkerService:
    """Serve the Tinker protocol over `session`'s ranks (a `Cluster`), or in this kernel when None;
    `watch()` names dead ranks (see `ClusterBackend`); `session_timeout` (s, 0: never) ends idle
    sessions, their models saved first.

    One service at a time: while one serves, another is refused (its clients keep their address
    and key); stop it first."""
    global _current
    if _current is not None and not _current.stopped:
        msg = (
            f"a Tinker service is already serving at {_current.url} ({_current.backend.where}); "
            "its clients would lose it. Stop it first with %nbtrain serve stop "
            "(nbtrain.current_service().stop()), or keep using that base_url"
        )
        raise ConfigError(msg)
    check_port(port)
    backend: Backend = (
        ClusterBackend(session, watch=watch) if session is not None else InProcessBackend()
    )
    service = TinkerService(
        backend,
        host=host,
        port=port,
        api_key=api_key,
        root=root,
        cluster_id=getattr(session, "cluster_id", None),
        world=getattr(session, "world_size", 1),
        session_timeout=session_timeout,
    )
    _current = service
    _export(service)
    _arm(service)
    return service


def check_port(port: Any) -> None:
    """A ConfigError unless `port` is a TCP port (0: a free one)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        msg = f"port={port!r} is not a TCP port: give 1-65535, or 0 for a free one"
        raise ConfigError(msg)


def _arm(service: TinkerService) -> None:
    # a preemption notice (SIGTERM, Slurm's --signal=USR1@90) checkpoints every live model: armed
    # in each rank's main thread, or in this kernel's where it serves (a thread cannot take signals)
    try:
        service.verbs.arm()
    except Exception as e:  # noqa: BLE001 - serving goes on; the notice then saves nothing
        print(
            f"nbtrain: the Tinker service could not arm its preemption checkpoints ({e}); a "
            "SIGTERM or SIGUSR1 will not save the models. Save them with save_state.",
            file=sys.stderr,
        )
        return
    if not service.verbs.armed and service.backend.arms_anywhere:
        print(
            "nbtrain: some ranks refused the preemption handlers (not their main thread); a "
            "preemption notice will not save the models there.",
            file=sys.stderr,
        )


def _stop_at_exit() -> None:
    # a kernel that ends leaves no run "running" in the registry (a cluster's stop does this too)
    if _current is not None:
        try:
            _current.stop()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


atexit.register(_stop_at_exit)


def current_service() -> TinkerService | None:
    """The service running in this kernel, or None."""
    return _current


def tinker_url() -> str:
    """The base_url of the Tinker service running in this kernel (%nbtrain serve tinker)."""
    if _current is None:
        msg = "no Tinker service is running in this kernel: start one with %nbtrain serve tinker (or Cluster.serve_tinker())."
        raise ConfigError(msg)
    return _current.url


def serve_tinker(
    cluster: Any = None,
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str | None = None,
    root: str | os.PathLike[str] | None = None,
    session_timeout: float = SESSION_TIMEOUT_S,
) -> TinkerService:
    """`nbtrain.serve_tinker()`: the Tinker service on `cluster`'s ranks, or in this kernel (None).
    A session with no heartbeat or request for `session_timeout` seconds (0: never) is ended, its
    models saved (the path is printed, and named to later requests) and then unloaded.

    In [1]: svc = nbtrain.serve_tinker()            # no cluster: the models live in this kernel
    In [2]: sc = tinker.ServiceClient(base_url=nbtrain.tinker_url())
    """
    return serve(
        cluster, host=host, port=port, api_key=api_key, root=root, session_timeout=session_timeout
    )
