"""What each endpoint does, without HTTP: sessions, models, samplers, and the futures of the verbs.

Requests are checked here, where they enter, so a bad one is a 400 (or an unknown model a 404)
before anything is queued; what the ranks refuse later (a `ConfigError`) fails its future with
category "user", anything else with category "server" and the cluster's message (rank, host, cause).
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nbtrain import atomic
from nbtrain.tinker.kernel import protocol as proto
from nbtrain.tinker.kernel import wire
from nbtrain.tinker.kernel.backend import Backend
from nbtrain.tinker.kernel.expiry import SESSION_TIMEOUT_S, Expiry, check_timeout
from nbtrain.tinker.kernel.futures import Executor, Future, Payload, Step
from nbtrain.tinker.kernel.protocol import RequestError, bad, get_field
from nbtrain.tinker.kernel.sampling import Sampling
from nbtrain.tinker.kernel.tracking import ModelRun, write_json

log = logging.getLogger(__name__)

MODEL_FILE = "model.json"  # in a model's folder: its base model and LoRA settings, for loads
#: under the service's folder: where a preemption notice writes every live model's state
PREEMPTED = "preempted"
ADAM_DEFAULTS = {
    "learning_rate": 1e-4,
    "beta1": 0.9,
    "beta2": 0.95,
    "eps": 1e-12,
    "weight_decay": 0.0,
    "grad_clip_norm": 0.0,
}


@dataclass
class Model:
    model_id: str
    session_id: str
    base_model: str
    lora: dict[str, Any]
    info: dict[str, Any] | None = None
    failed: str | None = None
    run: ModelRun | None = None
    #: the tinker path of its last save_state, what a restart reloads
    last_state: str | None = None


@dataclass
class Session:
    session_id: str
    created: float = field(default_factory=time.time)
    #: its last heartbeat or request (what `Expiry` measures idleness from)
    heartbeat: float = field(default_factory=time.time)
    finished: str | None = None
    #: why it expired and where its models' state went (`Expiry`)
    expired: str | None = None


class Verbs(Sampling, Expiry):
    """The service's state and its endpoints' logic; `backend` runs the verbs."""

    def __init__(
        self,
        backend: Backend,
        root: Path,
        cluster_id: str | None = None,
        world: int = 1,
        session_timeout: float = SESSION_TIMEOUT_S,
    ):
        self.backend = backend
        self.root = root
        self.cluster_id = cluster_id
        self.world = world
        # a model's training verbs queued back to back run in one trip to the ranks (`Step`)
        self.executor = Executor(backend.classify, backend.batch)
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, Model] = {}
        self.samplers: dict[str, dict[str, Any]] = {}
        self.session_timeout = check_timeout(session_timeout)
        self.expired: dict[str, str] = {}
        self._lock = threading.Lock()
        #: whether a preemption notice checkpoints the models (`arm`)
        self.armed = False

    @property
    def preempted(self) -> Path:
        """The folder a preemption notice writes every live model's state to, one folder each."""
        return self.root / PREEMPTED

    def arm(self) -> bool:
        """Arm the preemption notice where the models live (every rank, or this kernel)."""
        self.armed = self.backend.arm(str(self.preempted))
        return self.armed

    # --- sessions -------------------------------------------------------------------------------
    def create_session(self, body: dict[str, Any]) -> dict[str, Any]:
        sid = secrets.token_hex(8)
        with self._lock:
            self.sessions[sid] = Session(sid)
        return {"type": "create_session", "session_id": sid}

    def session(self, sid: Any, live: bool = True) -> Session:
        s = self.sessions.get(sid) if isinstance(sid, str) else None
        if s is None:
            raise RequestError(
                404, f"session {sid!r} is not known to this service (create_session first)."
            )
        if live and s.expired is not None:
            raise RequestError(404, f"{s.expired} Start a new session (a new ServiceClient).")
        self.touch(s)
        return s

    def heartbeat(self, body: dict[str, Any]) -> dict[str, Any]:
        s = self.session(body.get("session_id"), live=False)
        if s.finished is not None:
            # 410: the SDK stops heartbeating a finished session
            raise RequestError(
                410, s.expired or f"session {s.session_id} has finished ({s.finished})."
            )
        return {"type": "session_heartbeat"}

    def finish_session(self, sid: str, body: dict[str, Any]) -> dict[str, Any]:
        """Mark the session finished, free its models on the ranks, finish their runs."""
        s = self.session(sid, live=False)
        if s.finished is not None:
            return {}
        reason: dict[str, Any] = body["reason"] if isinstance(body.get("reason"), dict) else {}
        s.finished = str(reason.get("type") or "success")
        state = {"success": "done", "errored": "failed", "interrupted": "stopped"}.get(
            s.finished, "done"
        )
        for m in [m for m in self.models.values() if m.session_id == sid]:
            self.executor.submit(f"unload {m.model_id}", self._unloader(m, state))
        return {}

    def _unloader(self, m: Model, state: str) -> Any:
        def run() -> Payload:
            if m.info is not None:
                self.backend.unload(m.model_id)
            if m.run is not None:
                m.run.finish(state)
            with self._lock:
                self.models.pop(m.model_id, None)
            self.executor.forget(m.model_id)
            return ("json", {"type": "unload_model", "model_id": m.model_id})

        return run

    # --- models ---------------------------------------------------------------------------------
    def model(self, mid: Any) -> Model:
        if isinstance(mid, str) and mid in self.expired:
            raise RequestError(404, self.expired[mid])
        m = self.models.get(mid) if isinstance(mid, str) else None
        if m is not None:
            self.touch(self.sessions.get(m.session_id))
        if m is None:
            raise RequestError(
                404, f"model {mid!r} is not held by this service; create_model or load it first."
            )
        return m

    def _folder(self, mid: str) -> Path:
        return self.root / proto.folder_name(mid)

    def _lora(self, body: Any) -> dict[str, Any]:
        lora = body if isinstance(body, dict) else {}
        rank = lora.get("rank", 32)
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise bad(f"lora_config.rank must be a positive integer, not {rank!r}.")
        out = {"rank": rank, "seed": lora.get("seed")}
        for key in ("train_mlp", "train_attn", "train_unembed"):
            out[key] = bool(lora.get(key, True))
        if not (out["train_mlp"] or out["train_attn"] or out["train_unembed"]):
            raise bad(
                "lora_config: at least one of train_mlp, train_attn, train_unembed must be true."
            )
        return out

    @staticmethod
    def _check_optimizer(config: Any) -> None:
        kind = config.get("type", "adamw") if isinstance(config, dict) else "adamw"
        if kind != "adamw":
            raise bad(
                f"optimizer {kind!r} is not supported by nbtrain's Tinker service; use AdamW (the default)."
            )

    def _new_model(self, mid: str, sid: str, base: str, lora: dict[str, Any]) -> Model:
        with self._lock:
            if mid in self.models and self.models[mid].failed is None:
                raise bad(f"model {mid} already exists in this session (model_seq_id reused).")
            m = self.models[mid] = Model(mid, sid, base, lora)
        self.executor.expect(mid, 1)
        return m

    def _made(self, m: Model, info: dict[str, Any]) -> None:
        """A model now held by the ranks: its info, its folder's model.json, its run."""
        m.info = dict(info or {})
        write_json(
            self._folder(m.model_id) / MODEL_FILE, {"base_model": m.base_model, "lora": m.lora}
        )
        if m.run is None:
            m.run = ModelRun(
                self._folder(m.model_id),
                m.model_id,
                m.base_model,
                self.cluster_id,
                self.world,
                draw=self.backend.draws,
            )

    def create_model(self, body: dict[str, Any]) -> Future:
        s = self.session(body.get("session_id"))
        seq = get_field(body, "model_seq_id", int)
        base = get_field(body, "base_model", str)
        if not base:
            raise bad("base_model is empty; name a model folder the ranks can read.")
        self._check_optimizer(body.get("optimizer_config"))
        lora = self._lora(body.get("lora_config"))
        mid = proto.model_id(s.session_id, seq)
        m = self._new_model(mid, s.session_id, base, lora)

        def run() -> Payload:
            try:
                info = self.backend.create_model(mid, base, lora)
            except BaseException as e:
                m.failed = str(e)
                raise
            self._made(m, info)
            return ("json", {"type": "create_model", "model_id": mid})

        return self.executor.submit(f"create_model {mid}", run, model_id=None)

    def get_info(self, body: dict[str, Any]) -> dict[str, Any]:
        m = self.model(body.get("model_id"))
        if m.info is None:
            why = f"its creation failed: {m.failed}" if m.failed else "it is still being created"
            raise RequestError(404, f"model {m.model_id} is not ready ({why}).")
        tokenizer = m.info.get("tokenizer_id") or m.base_model
        return {
            "type": "get_info",
            "model_id": m.model_id,
            "model_data": {"arch": None, "model_name": m.base_model, "tokenizer_id": tokenizer},
            "is_lora": True,
            "lora_rank": m.lora["rank"],
            "model_name": m.base_model,
        }

    def capabilities(self) -> dict[str, Any]:
        bases = sorted({m.base_model for m in self.models.values()})
        return {
            "supported_models": [
                {"model_name": b, "trainable": True, "sampleable": True} for b in bases
            ]
        }

    # --- training verbs -------------------------------------------------------------------------
    def forward_backward(self, body: bytes) -> Future:
        req = wire.decode_forward_backward(body)
        m = self.model(req["model_id"])
        tokens = sum(len(d["tokens"]) for d in req["datums"])
        what = "forward" if req["forward_only"] else "forward_backward"

        def finish(result: dict[str, Any]) -> Payload:
            if not req["forward_only"] and m.run is not None:
                m.run.forward_backward(result.get("metrics") or {}, tokens)
            return ("proto", wire.encode_forward_backward(result))

        args = (
            m.model_id,
            req["datums"],
            req["loss_fn"],
            req["loss_fn_config"],
            req["forward_only"],
        )
        step = Step(self.backend.call, "forward_backward", args, finish)
        return self.executor.submit(f"{what} {m.model_id}", step, m.model_id, req["seq_id"])

    def optim_step(self, body: dict[str, Any]) -> Future:
        m = self.model(body.get("model_id"))
        params = body.get("adam_params") or body.get("optim_params") or body.get("optimizer_params")
        if not isinstance(params, dict):
            raise bad(
                "optim_step needs adam_params {learning_rate, beta1, beta2, eps, weight_decay, grad_clip_norm}."
            )
        self._check_optimizer(params)
        adam = dict(ADAM_DEFAULTS)
        for key in ADAM_DEFAULTS:
            value = params.get(key, ADAM_DEFAULTS[key])
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise bad(f"adam_params.{key} must be a number >= 0, not {value!r}.")
            adam[key] = float(value)
        if not (adam["beta1"] < 1 and adam["beta2"] < 1):
            raise bad("adam_params: beta1 and beta2 must be below 1.")

        def finish(metrics: dict[str, float] | None) -> Payload:
            metrics = metrics or {}
            if m.run is not None:
                m.run.optim_step(adam["learning_rate"], metrics)
            return (
                "json",
                {"type": "optim_step", "metrics": {k: float(v) for k, v in metrics.items()}},
            )

        step = Step(self.backend.call, "optim_step", (m.model_id, adam), finish)
        return self.executor.submit(
            f"optim_step {m.model_id}", step, m.model_id, body.get("seq_id")
        )

    # --- checkpoints ----------------------------------------------------------------------------
    def save_weights(self, body: dict[str, Any]) -> Future:
        m = self.model(body.get("model_id"))
        seq = body.get("seq_id")
        name = proto.check_name(body.get("path") or f"state-{seq or int(time.time())}")
        folder = proto.local_folder(self.root, m.model_id, "weights", name)
        path = proto.tinker_path(m.model_id, "weights", name)

        def run() -> Payload:
            folder.parent.mkdir(parents=True, exist_ok=True)
            self.backend.save_state(m.model_id, str(folder), True)
            m.last_state = path
            return ("json", {"type": "save_weights", "path": path})

        return self.executor.submit(f"save_weights {m.model_id}", run, m.model_id, seq)

    def _checkpoint(self, path: Any, kind: str) -> tuple[Path, dict[str, Any]]:
        """A saved checkpoint's folder and its model's settings; 404 when it is not there."""
        owner, found_kind, name = proto.parse_path(path)
        if found_kind != kind:
            use = "save_state / load_state" if found_kind == "weights" else "sampling"
            raise bad(f"{path} is a {found_kind} path, for {use}; this call takes a {kind} path.")
        folder = proto.local_folder(self.root, owner, kind, name)
        meta_file = self._folder(owner) / MODEL_FILE
        if not folder.exists() or not meta_file.is_file():
            raise RequestError(
                404, f"checkpoint {path} is not in this service's folder {self.root}."
            )
        return folder, json.loads(meta_file.read_text())

    def delete_checkpoint(self, owner: str, kind: str, name: str) -> dict[str, Any]:
        """DELETE training_runs/{model_id}/checkpoints/{kind}/{name} (the cookbook's rolling saves)."""
        folder, _ = self._checkpoint(proto.tinker_path(owner, kind, name), kind)
        for m in self.models.values():
            if m.last_state == proto.tinker_path(owner, kind, name):
                m.last_state = None  # a restart must not reload what is gone
        # renamed first, so a reader never sees half a folder
        atomic.remove_tree(folder, prefix=".deleted-")
        return {}

    def load_weights(self, body: dict[str, Any]) -> Future:
        optimizer = bool(body.get("optimizer", False))
        folder, meta = self._checkpoint(body.get("path"), "weights")
        path = body["path"]
        if body.get("session_id") is not None:
            # create-via-load: the load is the new model's first request
            s = self.session(body.get("session_id"))
            seq = get_field(body, "model_seq_id", int)
            self._check_optimizer(body.get("optimizer_config"))
            base = body.get("base_model") or meta["base_model"]
            mid = proto.model_id(s.session_id, seq)
            m = self._new_model(mid, s.session_id, base, dict(meta["lora"]))

            def create() -> Payload:
                try:
                    info = self.backend.load_state(mid, str(folder), optimizer, base, m.lora)
                except BaseException as e:
                    m.failed = str(e)
                    raise
                self._made(m, info)
                m.last_state = path
                return ("json", {"type": "load_weights", "path": path, "model_id": mid})

            return self.executor.submit(f"load_weights {mid}", create)
        m = self.model(body.get("model_id"))

        def load() -> Payload:
            self.backend.load_state(m.model_id, str(folder), optimizer, m.base_model, m.lora)
            return ("json", {"type": "load_weights", "path": path, "model_id": m.model_id})

        return self.executor.submit(
            f"load_weights {m.model_id}", load, m.model_id, body.get("seq_id")
        )

    def save_for_sampler(self, body: dict[str, Any]) -> Future:
        m = self.model(body.get("model_id"))
        seq = body.get("seq_id")
        if body.get("path"):
            name = proto.check_name(body["path"])
            folder = proto.local_folder(self.root, m.model_id, "sampler_weights", name)
            path = proto.tinker_path(m.model_id, "sampler_weights", name)

            def named() -> Payload:
                folder.parent.mkdir(parents=True, exist_ok=True)
                self.backend.save_sampler(m.model_id, str(folder))
                return ("json", {"type": "save_weights_for_sampler", "path": path})

            return self.executor.submit(
                f"save_weights_for_sampler {m.model_id}", named, m.model_id, seq
            )
        sseq = body.get("sampling_session_seq_id")
        if not isinstance(sseq, int):
            raise bad(
                "save_weights_for_sampler needs a path (a name) or a sampling_session_seq_id."
            )
        sampler = proto.sampler_id(m.session_id, sseq)

        def snapshot() -> Payload:
            self.backend.snapshot(m.model_id, sampler)
            self.samplers[sampler] = {
                "base_model": m.base_model,
                "model_path": None,
                "source": {"sampler_id": sampler},
                "model_id": m.model_id,
            }
            return ("json", {"type": "save_weights_for_sampler", "sampling_session_id": sampler})

        return self.executor.submit(f"snapshot {m.model_id}", snapshot, m.model_id, seq)

    # --- the kernel's view ----------------------------------------------------------------------
    def wait(self, what: str, fn: Any, timeout: float = 600.0) -> Any:
        """Run `fn` on the worker (after what is queued) and wait for it, in the kernel's thread."""
        fut = self.executor.submit(what, lambda: ("json", {"value": fn()}))
        kind, answer = fut.done.result(timeout)
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer["value"]

    def status(self, timeout: float = 60.0) -> list[dict[str, Any]]:
        """Every live model, as the ranks hold it (memory, steps), with its run folder and
        `batched`: [trips that ran several of its requests, requests they ran]; asked after the
        requests already queued (a TimeoutError past `timeout`)."""
        rows = self.wait("status", self.backend.status, timeout) or []
        for row in rows:
            row["batched"] = list(self.executor.batched.get(row.get("model_id"), [0, 0]))
            m = self.models.get(row.get("model_id"))
            row["folder"] = str(m.run.folder) if m is not None and m.run is not None else None
            row["last_state"] = m.last_state if m is not None else None
        return rows

    def _newest_state(self, m: Model) -> tuple[Path | None, str]:
        """The state a restart reloads `m` from: its last named save, or its preemption checkpoint
        where that is newer (or the only one); (folder, what to say), (None, "") for neither."""
        from nbtrain.tinker.ranks.state import META_FILE, checkpoint_folder

        def written(folder: Path | None) -> float | None:
            meta = folder / META_FILE if folder is not None else None
            return meta.stat().st_mtime if meta is not None and meta.is_file() else None

        named = self._checkpoint(m.last_state, "weights")[0] if m.last_state else None
        preempted = Path(checkpoint_folder(str(self.preempted), m.model_id))
        at_named, at_preempted = written(named), written(preempted)
        if at_preempted is not None and (at_named is None or at_preempted > at_named):
            than = f"newer than {m.last_state}" if m.last_state else "never saved by name"
            return preempted, f"its preemption checkpoint {preempted} ({than})"
        if named is not None:
            return named, str(m.last_state)
        return None, ""

    def reload(self) -> list[str]:
        """After a restart: every model back on the ranks, from its last saved state (its last named
        save, or its preemption checkpoint where newer; fresh where neither), its run continuing
        from the step that state holds."""
        self.executor.broken = None
        said = []

        def run() -> list[str]:
            if self.armed and self.backend.arms_anywhere:
                self.arm()  # replaced ranks start without the handlers
            for m in list(self.models.values()):
                if m.info is None:
                    continue
                folder, source = self._newest_state(m)
                if folder is not None:
                    out = self.backend.load_state(
                        m.model_id, str(folder), True, m.base_model, m.lora
                    )
                    steps = int((out or {}).get("steps", 0))
                    said.append(f"{m.model_id}: reloaded from {source}, at step {steps}")
                else:
                    try:
                        # the ranks that lived still hold it, the new ones do not: drop it everywhere
                        self.backend.unload(m.model_id)
                    except Exception:  # noqa: BLE001 - refused by the ranks that never had it
                        pass
                    self.backend.create_model(m.model_id, m.base_model, m.lora)
                    steps = 0
                    said.append(f"{m.model_id}: never saved, recreated with fresh LoRA weights")
                if m.run is not None:
                    m.run.resume(steps)
            return said

        return self.wait("reload", run)

    def close(self) -> None:
        # the worker first (what it runs now ends, what is queued fails): an unload it runs would
        # otherwise write a run's record while this thread writes it too
        self.executor.fail_all("the Tinker service was stopped.")
        self.executor.stop()
        for m in list(self.models.values()):
            if m.run is not None:
                m.run.finish("stopped")
