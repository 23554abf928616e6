"""One interface for the engines that generate: "hf" (transformers' `generate` on the rank's own model,
the default and the reference) and "vllm" (a vLLM engine beside the rank, `vllm_engine`).

In [1]: eng = engines.make("vllm", model_path="tiny-qwen", tokenizer=tok, device=d.device, rank=d.rank,
   ...:                    host=d.host, lora=engines.LoraSpec(r=8, alpha=16))
In [2]: eng.set_adapter(peft_model)                 # after each optimizer step: the LoRA, in memory
In [3]: out = eng.generate(prompts, decode.Decoding(max_new_tokens=32), logprobs=True)

Whichever engine runs, a call takes the same prompts (`decode.Prompt`, token ids) and `decode.Decoding`
(stopping: eos, `stop` strings, `stop_token_ids`, `max_new_tokens`; seeds; temperature, top-p, top-k)
and returns the same `Completion`s: the generated ids cut by `decode.cut`, and each token's
log-probability under the model's raw logits (temperature and top-p/top-k not applied), which is what
GRPO's importance ratio compares with the training model's. Every method is local to the rank.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nbtrain.errors import NbtrainError
from nbtrain.generation import decode

ENGINES = ("hf", "vllm")


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


class HFEngine(Engine):
    """transformers' `generate` with a KV cache on the rank's own model (`decode.generate_batch`), in
    batches of `decoding.batch_size`; the model generates in eval mode and goes back as it was."""

    name = "hf"

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        device: Any,
        autocast: Callable[[], Any] = contextlib.nullcontext,
    ) -> None:
        self.model, self.tokenizer, self.device, self.autocast = model, tokenizer, device, autocast

    def generate(
        self, prompts: list[decode.Prompt], decoding: decode.Decoding, logprobs: bool = False
    ) -> list[Completion]:
        was_training = self.model.training
        self.model.eval()
        out: list[Completion] = []
        t0 = time.perf_counter()
        try:
            for b in range(0, len(prompts), decoding.batch_size):
                rows = decode.generate_batch(
                    self.model,
                    self.tokenizer,
                    prompts[b : b + decoding.batch_size],
                    decoding,
                    self.device,
                    autocast=self.autocast,
                    logprobs=logprobs,
                )
                out += [
                    Completion(
                        r["index"], r["ids"], r["completion"], r["logprobs"], r["stopped"], 0.0
                    )
                    for r in rows
                ]
        finally:
            self.model.train(was_training)
        took = time.perf_counter() - t0
        for c in out:
            c.seconds = took
        return out


def make(
    engine: str,
    *,
    tokenizer: Any,
    device: Any,
    model: Any = None,
    model_path: str | None = None,
    autocast: Callable[[], Any] = contextlib.nullcontext,
    lora: LoraSpec | None = None,
    rank: int = 0,
    host: str = "",
    options: VLLMOptions | None = None,
) -> Engine:
    """An engine on this rank: "hf" generates from `model`; "vllm" starts vLLM on `model_path` (the
    base weights, loaded once; `lora` makes room for adapters), after checking its versions."""
    problems = check_name(engine)
    if problems:
        raise ValueError(problems[0])
    if engine == "hf":
        if model is None:
            msg = 'engine="hf" generates from the rank\'s own model: pass model='
            raise ValueError(msg)
        return HFEngine(model, tokenizer, device, autocast)
    from nbtrain.generation import vllm_engine

    if model_path is None:
        msg = 'engine="vllm" loads its own weights: pass model_path= (a model folder or Hub id)'
        raise ValueError(msg)
    return vllm_engine.VLLMEngine(
        model_path, tokenizer, device, lora, rank, host, options or VLLMOptions()
    )


def check_vllm(rank: int, host: str) -> None:
    """Raise `EngineError` if vLLM is missing or its versions do not work together, before any model
    loads (`nbtrain.engine.preflight.vllm_problem`)."""
    from nbtrain.engine.preflight import vllm_problem

    problem = vllm_problem()
    if problem:
        msg = f'engine="vllm" on rank {rank} ({host}): {problem}'
        raise EngineError(msg)
