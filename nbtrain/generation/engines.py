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

__all__ = [
    "ENGINES",
    "Completion",
    "Engine",
    "EngineError",
    "HFEngine",
    "LoraSpec",
    "VLLMOptions",
    "check_name",
    "check_vllm",
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
