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
import logging
import time
from collections.abc import Callable
from typing import Any

from nbtrain.generation import decode
from nbtrain.generation.engine_base import (
    ENGINES,
    Completion,
    Engine,
    EngineError,
    LoraSpec,
    VLLMOptions,
    check_name,
    check_vllm,
)

log = logging.getLogger(__name__)

__all__ = [
    "ENGINES",
    "Completion",
    "Engine",
    "EngineError",
    "HFEngine",
    "LoraSpec",
    "VLLMOptions",
    "call_problems",
    "check_name",
    "check_vllm",
    "from_model",
    "make",
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
        out: list[Completion] = []
        t0 = time.perf_counter()
        with decode.generation_mode(self.model):
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


def call_problems(decoding: decode.Decoding, engine: Any, chat_template_kwargs: Any) -> list[str]:
    """What is wrong with a generate call's decoding, `engine` and `chat_template_kwargs` (none: [])."""
    problems = decoding.problems() + check_name(engine)
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        problems.append(
            f"chat_template_kwargs={chat_template_kwargs!r} must be a dict such as {{'enable_thinking': False}}, or None"
        )
    return problems


def from_model(
    model: Any,
    tokenizer: Any,
    prompts: list[decode.Prompt],
    d: Any,
    decoding: decode.Decoding,
    *,
    engine: str = "hf",
    synced: bool = False,
    autocast: Callable[[], Any] = contextlib.nullcontext,
    model_path: str | None = None,
    lora: LoraSpec | None = None,
) -> list[dict[str, Any]] | None:
    """Every prompt's completion from `model` as it is now, across the ranks of `d`: rank 0 gets the rows
    of `decode.generate_across`, the others None; the model generates in `decode.generation_mode`.

    engine "hf": transformers' `generate` on `model` itself (`synced`: it is sharded). "vllm": the rank's
    kept vLLM engine on the base `model_path` (`vllm_engine.kept`, with room for `lora`), given `model`'s
    adapter as it is now, in memory; the engine is kept for the next call (asleep, on a GPU) unless it
    failed. Every rank must call it alike."""
    problems = check_name(engine)
    if problems:
        raise ValueError(problems[0])
    with decode.generation_mode(model):
        if engine == "hf":
            return decode.generate_across(model, tokenizer, prompts, d, decoding, synced, autocast)
        from nbtrain.generation import vllm_engine

        if model_path is None:
            msg = 'engine="vllm" loads its own weights: pass model_path= (the base model)'
            raise ValueError(msg)
        # every rank has its engine before any generates: one that fails stops all of them
        eng = d.agree(
            lambda: vllm_engine.kept(model_path, tokenizer, d.device, lora, d.rank, d.host)
        )
        try:
            eng.set_adapter(model)
            rows = decode.generate_across(model, tokenizer, prompts, d, decoding, engine=eng)
        except BaseException:
            vllm_engine.forget()  # an engine that failed, or was interrupted mid-call, is not kept
            raise
        eng.sleep()  # on a GPU, its memory back to training until the next call
        return rows
