"""The HTTP side: tornado handlers for the tinker 0.38.0 SDK's REST protocol (base path /api/v1).

Every user error (a `RequestError`, a `ConfigError`, a body that is not JSON or protobuf) is a 4xx
with {"detail": message}: the SDK retries 408, 409, 429 and 5xx for minutes, so nothing a request
says may end in a 500. Anything else is nbtrain's own fault: a 500 whose body carries an error id,
logged here with its traceback under that id (`internal_error`). Long verbs answer at once with a
future; `retrieve_future` waits up to `POLL_S` for it, then says "try_again".
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from typing import Any

import tornado.web

from nbtrain.errors import ConfigError
from nbtrain.tinker.kernel.futures import Future
from nbtrain.tinker.kernel.protocol import RequestError, bad
from nbtrain.tinker.kernel.verbs import Verbs

log = logging.getLogger(__name__)

POLL_S = 30.0  # the SDK polls again at once on try_again (and logs a warning), so the server holds each poll this long (its timeout is 45 s)
PROTO = "application/x-protobuf"
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "parallel_fwdbwd_chunks": True,
    "proto_compress_fwdbwd": False,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
}


class Base(tornado.web.RequestHandler):
    verbs: Verbs
    api_key: str | None

    def initialize(self, verbs: Verbs, api_key: str | None) -> None:
        self.verbs = verbs
        self.api_key = api_key

    def prepare(self) -> None:
        if self.api_key is None:
            return
        given = self.request.headers.get("X-API-Key") or ""
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            self.fail(
                401,
                "missing or wrong API key: set TINKER_API_KEY to the key %nbtrain serve tinker printed.",
            )
            raise tornado.web.Finish()

    def check_xsrf_cookie(self) -> None:  # an API for programs, not a browser form
        return

    def fail(self, status: int, message: str) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"detail": message}))

    def reply(self, data: Any) -> None:
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(data))

    def body(self) -> dict[str, Any]:
        raw = self.request.body or b"{}"
        if self.request.headers.get("Content-Encoding", "").lower() == "zstd":
            import zstandard

            try:
                raw = zstandard.ZstdDecompressor().decompress(raw)
            except zstandard.ZstdError as e:
                raise bad(f"the zstd body cannot be decompressed ({e}).") from e
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise bad(f"the request body is not JSON ({e}).") from e
        if not isinstance(data, dict):
            raise bad("the request body must be a JSON object.")
        return data

    def raw(self) -> bytes:
        raw = self.request.body or b""
        if self.request.headers.get("Content-Encoding", "").lower() == "zstd":
            import zstandard

            try:
                raw = zstandard.ZstdDecompressor().decompress(raw)
            except zstandard.ZstdError as e:
                raise bad(f"the zstd body cannot be decompressed ({e}).") from e
        return raw

    def future(self, fut: Future, **extra: Any) -> None:
        self.reply({"request_id": fut.request_id, "model_id": fut.model_id, **extra})

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, tornado.web.HTTPError) and status_code < 500:
            self.fail(status_code, exc.log_message or self._reason)
            return
        if exc is not None and not isinstance(exc, tornado.web.HTTPError):
            self.internal_error(exc)  # an exception that escaped a handler: nbtrain's own fault
            return
        self.fail(status_code, f"nbtrain's Tinker service failed: {self._reason}")

    def log_exception(self, typ: Any, value: Any, tb: Any) -> None:
        # write_error logs an escaped exception once, with the error id its 500 carries
        if isinstance(value, tornado.web.HTTPError):
            super().log_exception(typ, value, tb)

    def internal_error(self, e: BaseException) -> None:
        """Answer an error of nbtrain's own (not the request's) with a 500 and an error id, and log
        its traceback under that id, where the body says to look for it."""
        error_id = uuid.uuid4().hex[:8]
        where = f"{self.request.method} {self.request.path}"
        log.error(
            "Tinker service error %s on %s: %s: %s",
            error_id,
            where,
            type(e).__name__,
            e,
            exc_info=e,
        )
        message = (
            f"nbtrain's Tinker service failed on {where} ({type(e).__name__}: {e}); this is a bug "
            f"in nbtrain, not in the request. Look for error id {error_id} in the kernel's log "
            "(its stderr, logger nbtrain.tinker.kernel.handlers), which has the traceback, and "
            "report it."
        )
        self.set_status(500)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"detail": message, "error": message, "error_id": error_id}))


def endpoint(method: str, call: Any, kind: str = "json") -> type[Base]:
    """A handler for one endpoint: parse the body (`kind`), call `call(verbs, body, *path args)`,
    answer its dict, or its future ({request_id, model_id}); RequestErrors become 4xx."""

    async def handle(self: Base, *args: str) -> None:
        arg: Any = None
        began = time.monotonic()
        try:
            if kind == "json":
                arg = self.body()
            elif kind == "proto":
                arg = self.raw()
            else:
                arg = None
            result = call(self.verbs, arg, *args)
        except (RequestError, ConfigError) as e:
            status = e.status if isinstance(e, RequestError) else 400
            model_id, seq_id = getattr(e, "model_id", None), getattr(e, "seq_id", None)
            if isinstance(arg, dict) and model_id is None:
                model_id, seq_id = arg.get("model_id"), arg.get("seq_id")
            self.verbs.executor.skip(model_id, seq_id)
            log.debug("%s %s refused (%d): %s", method, self.request.path, status, e)
            self.fail(status, str(e))
            return
        except Exception as e:
            # nbtrain's own bug, not the request's: a 500 with an id, the traceback logged under it
            if isinstance(arg, dict):
                self.verbs.executor.skip(arg.get("model_id"), arg.get("seq_id"))
            self.internal_error(e)
            return
        model = arg.get("model_id") if isinstance(arg, dict) else None
        log.debug(
            "%s %s model %s: %.3f s", method, self.request.path, model, time.monotonic() - began
        )
        if isinstance(result, Future):
            self.future(result)
        elif isinstance(result, tuple):  # asample: (future, num_samples)
            fut, n = result
            ids = [f"{fut.request_id}:{i}" for i in range(n)]
            self.future(fut, sample_sequence_ids=ids)
        else:
            self.reply(result)

    return type(f"{method}_{getattr(call, '__name__', 'call')}", (Base,), {method.lower(): handle})


class RetrieveFuture(Base):
    async def post(self) -> None:
        try:
            body = self.body()
        except RequestError as e:
            self.fail(e.status, str(e))
            return
        rid = body.get("request_id")
        fut = self.verbs.executor.get(rid) if isinstance(rid, str) else None
        if fut is None:
            self.fail(
                404, f"request {rid!r} is not known to this service (it may have been restarted)."
            )
            return
        self.verbs.seen(fut.model_id)  # a client that polls is alive
        if not fut.finished():
            wrapped = asyncio.wrap_future(fut.done)
            await asyncio.wait([wrapped], timeout=POLL_S)
        if not fut.finished():
            self.reply({"type": "try_again", "request_id": rid, "queue_state": "active"})
            return
        kind, payload = fut.answer()
        if kind == "proto":
            self.set_header("Content-Type", PROTO)
            self.finish(payload)
        else:
            self.reply(payload)


class NotFound(Base):
    def prepare(self) -> None:
        super().prepare()
        self.fail(
            404,
            f"{self.request.method} {self.request.path} is not an endpoint of nbtrain's Tinker service.",
        )
        raise tornado.web.Finish()


def routes(verbs: Verbs, api_key: str | None) -> list[Any]:
    """The URL table of one service."""
    v = "/api/v1"
    table: list[tuple[str, type[Base]]] = [
        (f"{v}/healthz", endpoint("GET", lambda s, b: {"status": "ok"}, "none")),
        (f"{v}/get_server_capabilities", endpoint("GET", lambda s, b: s.capabilities(), "none")),
        (f"{v}/client/config", endpoint("POST", lambda s, b: CLIENT_CONFIG)),
        (
            f"{v}/client/dynamic_config",
            endpoint("POST", lambda s, b: {"refresh_interval_sec": 300}),
        ),
        (f"{v}/telemetry", endpoint("POST", lambda s, b: {"status": "accepted"})),
        (f"{v}/create_session", endpoint("POST", Verbs.create_session)),
        (f"{v}/session_heartbeat", endpoint("POST", Verbs.heartbeat)),
        (
            f"{v}/sessions/([^/]+)/finish",
            endpoint("POST", lambda s, b, sid: s.finish_session(sid, b)),
        ),
        (f"{v}/create_model", endpoint("POST", Verbs.create_model)),
        (f"{v}/get_info", endpoint("POST", Verbs.get_info)),
        (f"{v}/forward_backward", endpoint("POST", Verbs.forward_backward, "proto")),
        (f"{v}/optim_step", endpoint("POST", Verbs.optim_step)),
        (f"{v}/save_weights", endpoint("POST", Verbs.save_weights)),
        (f"{v}/load_weights", endpoint("POST", Verbs.load_weights)),
        (f"{v}/save_weights_for_sampler", endpoint("POST", Verbs.save_for_sampler)),
        (f"{v}/create_sampling_session", endpoint("POST", Verbs.create_sampling_session)),
        (f"{v}/samplers/([^/]+)", endpoint("GET", lambda s, b, sid: s.get_sampler(sid), "none")),
        (f"{v}/asample", endpoint("POST", Verbs.asample)),
        (f"{v}/cancel_future", endpoint("POST", lambda s, b: {})),
        (f"{v}/retrieve_future", RetrieveFuture),
        (
            f"{v}/training_runs/([^/]+)/checkpoints/(weights|sampler_weights)/([^/]+)",
            endpoint("DELETE", lambda s, b, o, k, n: s.delete_checkpoint(o, k, n), "none"),
        ),
    ]
    args = {"verbs": verbs, "api_key": api_key}
    return [(pattern, handler, args) for pattern, handler in table] + [(r".*", NotFound, args)]
