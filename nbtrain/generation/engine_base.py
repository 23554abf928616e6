"""What every generation engine shares (`engines` has the engines): the completion they return, the
base class, their error, and the settings of a vLLM engine. Kept apart so that `vllm_engine` and
`engines` both build on it without importing each other.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from nbtrain.configs.sft import ENGINES
from nbtrain.errors import NbtrainError
from nbtrain.generation import decode

log = logging.getLogger(__name__)


class EngineError(NbtrainError, RuntimeError):
    """A generation engine could not start, or died: the message names the rank, the host, the cause
    and the last lines of the engine's log."""


def check_name(engine: Any, setting: str = "engine") -> list[str]:
    """Problems with an engine setting (for config validation, before anything runs)."""
    if engine in ENGINES:
        return []
    return [f"{setting}={engine!r} is not an engine; use one of {', '.join(map(repr, ENGINES))}"]


@dataclass
class Completion:
    """One prompt's completion: `ids` generated (cut after the first eos/stop id, or the token that
    completes a stop string), `logprobs` one per id (None unless asked for), `stopped` (False: it ran
    to max_new_tokens), `seconds` of the call it came from."""

    index: int
    ids: list[int]
    text: str
    logprobs: list[float] | None
    stopped: bool
    seconds: float


@dataclass
class LoraSpec:
    """The LoRA shape an engine must make room for at start (vLLM sizes its LoRA slots once)."""

    r: int = 8
    alpha: float = 16
    target_modules: Any = "all-linear"


@dataclass
class VLLMOptions:
    """How a vLLM engine starts (`vllm_engine`)."""

    gpu_memory_utilization: float = (
        0.3  #: share of the GPU vLLM takes (weights + KV cache); the rest trains
    )
    sleep: bool = True  #: on a GPU, free vLLM's memory between rollouts (`sleep()`/`wake()`)
    max_model_len: int | None = None  #: longest prompt + completion; None: the model's own
    enforce_eager: bool = True  #: no CUDA graphs (faster start; set False for long runs on a GPU)
    dtype: str = "auto"
    cpu_kv_cache_gib: int = 1  #: the CPU build's KV cache (VLLM_CPU_KVCACHE_SPACE)
    cpu_threads: int | None = None  #: the CPU build's threads; None: torch's for this rank
    start_timeout: float = 900.0  #: seconds to wait for the engine to start
    extra: dict[str, Any] = field(default_factory=dict)  #: more arguments for vllm.LLM(...)


class Engine:
    """What every engine offers; `rows` is the shape `decode.generate_across` reads."""

    name = ""

    def generate(
        self, prompts: list[decode.Prompt], decoding: decode.Decoding, logprobs: bool = False
    ) -> list[Completion]:
        raise NotImplementedError

    def set_adapter(self, adapter: Any) -> None:
        """The LoRA to generate with from now on: a peft model (its current weights), an adapter folder,
        or None (the base)."""

    def sleep(self) -> None:
        """Free the engine's GPU memory for training (a no-op where there is nothing to free)."""

    def wake(self) -> None:
        """Take the memory back before generating."""

    def close(self) -> None:
        """End the engine (its process, where it has one)."""

    def rows(self, batch: list[decode.Prompt], decoding: decode.Decoding) -> list[dict[str, Any]]:
        return [
            {
                "index": c.index,
                "completion": c.text,
                "tokens": len(c.ids),
                "seconds": c.seconds,
                "ids": c.ids,
                "logprobs": c.logprobs,
                "stopped": c.stopped,
            }
            for c in self.generate(batch, decoding)
        ]


def check_vllm(
    rank: int, host: str, model: str | None = None, device: Any = None, lora: bool = True
) -> None:
    """Raise `EngineError` before any model loads if engine="vllm" cannot serve `model` (with a LoRA
    where `lora`) on `device` (on a CPU: a family vLLM's CPU build does not run, in
    `nbtrain.model.families.VLLM_CPU_FAMILIES`), or if vLLM is missing or its versions do not work
    together (`nbtrain.engine.preflight.vllm_problem`)."""
    from nbtrain.engine.preflight import vllm_problem

    # the family first: where vLLM cannot run the model, installing it would not help
    if model is not None and getattr(device, "type", str(device)) != "cuda":
        from nbtrain.model.families import vllm_family_refusal
        from nbtrain.model.pretrained import check_causal_lm

        refusal = vllm_family_refusal(check_causal_lm(str(model)), lora)
        if refusal:
            msg = (
                f'engine="vllm" on rank {rank} ({host}): {refusal}. Use engine="hf" '
                "(transformers' generate, which runs every family), or a GPU with the vllm build"
            )
            raise EngineError(msg)
    problem = vllm_problem()
    if problem:
        msg = f'engine="vllm" on rank {rank} ({host}): {problem}'
        raise EngineError(msg)
