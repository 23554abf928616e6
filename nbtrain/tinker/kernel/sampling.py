"""The sampling endpoints: sampling sessions (a snapshot of a model, a saved sampler folder, or
the base model alone) and `asample`, whose result is a protobuf `SampleResponse`. Samples drawn
from a model's weights are shown in its run (samples.jsonl and the live display)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from nbtrain.tinker.kernel import protocol as proto
from nbtrain.tinker.kernel import wire
from nbtrain.tinker.kernel.backend import Backend
from nbtrain.tinker.kernel.futures import Executor, Future, Payload
from nbtrain.tinker.kernel.protocol import RequestError, bad, get_field

log = logging.getLogger(__name__)

SAMPLE_DEFAULTS = {"max_tokens": 16, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "seed": None}


class Sampling:
    """The sampling half of `Verbs` (which holds the state these methods use)."""

    backend: Backend
    executor: Executor
    models: dict[str, Any]
    samplers: dict[str, dict[str, Any]]

    def session(self, sid: Any) -> Any:
        raise NotImplementedError

    def _checkpoint(self, path: Any, kind: str) -> tuple[Path, dict[str, Any]]:
        raise NotImplementedError

    def _source(self, model_path: Any, base_model: Any) -> dict[str, Any]:
        if model_path:
            folder, meta = self._checkpoint(model_path, "sampler_weights")
            base = base_model or meta["base_model"]
            owner = proto.parse_path(model_path)[0]
            return {
                "base_model": base,
                "model_path": model_path,
                "source": {"path": str(folder), "base_model": base},
                "model_id": owner if owner in self.models else None,
            }
        if not isinstance(base_model, str) or not base_model:
            raise bad(
                "a sampler needs model_path (a tinker://.../sampler_weights/... path) or base_model."
            )
        return {"base_model": base_model, "model_path": None, "source": {"base_model": base_model}}

    def create_sampling_session(self, body: dict[str, Any]) -> dict[str, Any]:
        s = self.session(body.get("session_id"))
        seq = get_field(body, "sampling_session_seq_id", int)
        entry = self._source(body.get("model_path"), body.get("base_model"))
        sampler = proto.sampler_id(s.session_id, seq)
        self.samplers[sampler] = entry
        return {"type": "create_sampling_session", "sampling_session_id": sampler}

    def get_sampler(self, sampler: str) -> dict[str, Any]:
        entry = self.samplers.get(sampler)
        if entry is None:
            raise RequestError(404, f"sampler {sampler!r} is not known to this service.")
        return {
            "sampler_id": sampler,
            "base_model": entry["base_model"],
            "model_path": entry["model_path"],
        }

    def asample(self, body: dict[str, Any]) -> tuple[Future, int]:
        if body.get("sampling_session_id"):
            sampler = body["sampling_session_id"]
            if sampler not in self.samplers:
                raise RequestError(404, f"sampler {sampler!r} is not known to this service.")
            entry = self.samplers[sampler]
        else:
            entry = self._source(body.get("model_path"), body.get("base_model"))
        source = entry["source"]
        owner = self.models.get(entry.get("model_id") or "")
        prompt = wire.model_input_tokens(body.get("prompt"))
        n = get_field(body, "num_samples", int, 1)
        if n < 1:
            raise bad(f"num_samples must be at least 1, not {n}.")
        if body.get("prompt_alt_tokens_k"):
            raise bad(
                "prompt_alt_tokens_k (prompt alternative tokens) is not supported by nbtrain's "
                "Tinker service; topk_prompt_logprobs gives the most likely tokens at each position."
            )
        topk_prompt = get_field(body, "topk_prompt_logprobs", int, 0) or 0
        topk_sample = get_field(body, "topk_sample_logprobs", int, 0) or 0
        if topk_prompt < 0 or topk_sample < 0:
            raise bad("topk_prompt_logprobs and topk_sample_logprobs must be integers >= 0.")
        if body.get("target_prompt_logprobs") is not None:
            raise bad("target_prompt_logprobs is not supported by nbtrain's Tinker service.")
        params = self._sampling_params(body.get("sampling_params"))
        want_plp = bool(body.get("prompt_logprobs"))
        last_n = body.get("prompt_logprobs_last_n")
        if last_n is not None and not (
            isinstance(last_n, int) and want_plp and 1 <= last_n <= len(prompt) - 1
        ):
            raise bad(
                f"prompt_logprobs_last_n={last_n!r} needs prompt_logprobs and must be between 1 and "
                f"len(prompt) - 1 = {len(prompt) - 1}."
            )

        def run() -> Payload:
            t0 = time.time()
            result = self.backend.sample(
                source, prompt, n, params, want_plp, topk_prompt, topk_sample
            )
            if owner is not None and owner.run is not None and params["max_tokens"] > 1:
                # a compute_logprobs (max_tokens 1) is not a sample worth showing
                owner.run.samples(prompt, result.get("sequences") or [], time.time() - t0)
            return ("proto", wire.encode_sample(result, last_n))

        return self.executor.submit("sample", run), n

    @staticmethod
    def _sampling_params(raw: Any) -> dict[str, Any]:
        if not isinstance(raw, dict):
            raise bad(
                "sampling_params must be an object (max_tokens, temperature, top_p, top_k, seed, stop)."
            )
        params: dict[str, Any] = dict(SAMPLE_DEFAULTS)
        for key in SAMPLE_DEFAULTS:
            if raw.get(key) is not None:
                params[key] = raw[key]
        if not isinstance(params["max_tokens"], int) or params["max_tokens"] < 1:
            raise bad(
                f"sampling_params.max_tokens must be a positive integer, not {params['max_tokens']!r}."
            )
        if float(params["temperature"]) < 0 or not 0 < float(params["top_p"]) <= 1:
            raise bad("sampling_params: temperature must be >= 0 and top_p in (0, 1].")
        stop = raw.get("stop")
        params["stop"] = (
            [stop] if isinstance(stop, str) else (list(stop) if stop is not None else None)
        )
        return params
