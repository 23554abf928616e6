"""Generation across the ranks of a run: prompts read and tokenized, split across ranks, batched with left
padding and a KV cache (transformers' `generate`), and gathered back in prompt order.

Shared by `nbtrain.generate` (`nbtrain.generation.generate`) and the samples a run takes while it trains
(`nbtrain.generation.sampling`). Prompts are plain strings, chat message lists (rendered with the template's
generation prompt, as training renders a row's prompt), or rows in the formats `finetune` reads, whose
completion (or last assistant turn) becomes the reference.

Prompts are sorted by length and dealt to the ranks in turn, so a batch holds prompts of about the same
length (little padding) and every rank gets about the same work. Under FSDP every rank must run the same
forward passes: each runs the same number of batches (a rank short of prompts repeats one and drops the
result) and `generate(synced_gpus=True)` keeps decoding until every rank is done. That flag all-reduces
over the default group, so on a sub-group (`group=`) every rank decodes `max_new_tokens` steps instead,
never stopping at the end-of-sequence token, and each completion is cut at its first one afterwards:
the same tokens, the same forward passes on every rank of the group, and none outside it waited for.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from nbtrain.data import chat
from nbtrain.data.prompts import Entry
from nbtrain.engine.signals import interrupts
from nbtrain.errors import ConfigError, NbtrainError
from nbtrain.generation.utf8 import decode_completion

log = logging.getLogger(__name__)


class EngineFailedElsewhere(NbtrainError, RuntimeError):
    """Another rank's generation engine failed; this rank's part was fine (that rank says why)."""


@dataclass
class Prompt:
    """One prompt, tokenized: `index` is its place in the input."""

    index: int
    prompt: Any
    ids: list[int]
    reference: str | None = None


@dataclass
class Decoding:
    """How to decode: greedy unless `do_sample`; a sampled run draws from its own seeded generator."""

    max_new_tokens: int = 64
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  #: 0: no top-k cut
    seed: int = 0
    batch_size: int = 8
    stop: tuple[str, ...] = ()  #: strings that end a completion (after the token completing one)
    stop_token_ids: tuple[int, ...] = ()  #: token ids that end it, beside the model's eos

    def problems(self) -> list[str]:
        out = []

        def positive(name: str) -> None:
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                out.append(f"{name}={v!r} must be an integer >= 1")

        positive("max_new_tokens")
        positive("batch_size")
        if not isinstance(self.do_sample, bool):
            out.append(f"do_sample={self.do_sample!r} must be True or False")
        if not (isinstance(self.temperature, int | float) and self.temperature > 0):
            out.append(f"temperature={self.temperature!r} must be > 0 (do_sample=False for greedy)")
        if not (isinstance(self.top_p, int | float) and 0 < self.top_p <= 1):
            out.append(f"top_p={self.top_p!r} must be in (0, 1]")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            out.append(f"top_k={self.top_k!r} must be an integer >= 0 (0: no top-k cut)")
        if not (isinstance(self.seed, int) and not isinstance(self.seed, bool)):
            out.append(f"seed={self.seed!r} must be an integer")
        if not all(isinstance(x, str) and x for x in self.stop):
            out.append(f"stop={self.stop!r} must be non-empty strings")
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in self.stop_token_ids):
            out.append(f"stop_token_ids={self.stop_token_ids!r} must be token ids (integers)")
        return out


def cut(ids: list[int], stop_ids: Any, stop: tuple[str, ...], tokenizer: Any) -> tuple[int, bool]:
    """How many of `ids` a completion keeps, and whether it stopped: up to and with the first stop id,
    or the token whose text completes a stop string. Both engines cut with this, so they agree."""
    n = next((k + 1 for k, t in enumerate(ids) if t in stop_ids), len(ids))
    stopped = n < len(ids) or bool(ids and ids[n - 1] in stop_ids)
    if stop:
        text = tokenizer.decode(ids[:n], skip_special_tokens=True)
        if any(s in text for s in stop):
            # the shortest prefix whose text holds a stop string
            for k in range(1, n + 1):
                if any(s in tokenizer.decode(ids[:k], skip_special_tokens=True) for s in stop):
                    return k, True
    return n, stopped


def encode(
    entries: list[Entry], tokenizer: Any, template_kwargs: dict | None = None
) -> list[Prompt]:
    """The prompts' token ids: a string as training tokenizes a text row (the tokenizer's special tokens),
    a message list through the chat template with the generation prompt (`template_kwargs` for every
    prompt, a row's own win; e.g. {'enable_thinking': False})."""
    out = []
    for i, e in enumerate(entries):
        if isinstance(e.prompt, str):
            ids = tokenizer(e.prompt, add_special_tokens=True)["input_ids"]
        else:
            kwargs = {**(template_kwargs or {}), **(e.template_kwargs or {})} or None
            try:
                text = chat.generation_prompt(tokenizer, e.prompt, e.tools, kwargs)
            except ConfigError as err:
                msg = f"prompt {i}: {err}"
                raise ConfigError(msg) from None
            # the template writes its own special tokens
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            msg = f"prompt {i} is empty (no tokens); give it some text"
            raise ConfigError(msg)
        out.append(Prompt(i, e.prompt, list(ids), e.reference))
    return out


# --------------------------------------------------------------------------------------- generating
def deal(prompts: list[Prompt], rank: int, world: int, batch_size: int) -> list[list[Prompt]]:
    """This rank's batches: prompts sorted by length, dealt to the ranks in turn, cut into batches."""
    order = sorted(prompts, key=lambda p: (len(p.ids), p.index))
    mine = order[rank::world]
    return [mine[i : i + batch_size] for i in range(0, len(mine), batch_size)]


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


@contextlib.contextmanager
def own_rng(seed: int, device: Any) -> Iterator[None]:
    """The generator state seeded with `seed` inside, the caller's (the training's) put back after."""
    import torch

    devices = list(range(torch.cuda.device_count())) if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


@contextlib.contextmanager
def generation_mode(model: Any) -> Iterator[Any]:
    """`model` in eval mode (no dropout drawn) with its KV cache on (`config.use_cache`) inside; its
    train mode and `use_cache` as they were after, an exception or interrupt included.

    In [1]: with decode.generation_mode(peft_model):
       ...:     rows = decode.generate_across(peft_model, tok, prompts, d, decoding)
    """
    was_training = model.training
    config: Any = getattr(model, "config", None)
    # a config without the setting (not a transformers model) is left without it
    had_cache = config is not None and hasattr(config, "use_cache")
    use_cache = config.use_cache if had_cache else None
    model.eval()
    try:
        if had_cache:
            config.use_cache = True
        yield model
    finally:
        model.train(was_training)
        if had_cache:
            config.use_cache = use_cache


def generate_kwargs(
    decoding: Decoding,
    pad: int,
    eos: list[int],
    tokenizer: Any,
    *,
    synced: bool = False,
    full_length: bool = False,
    logprobs: bool = False,
) -> dict[str, Any]:
    """The keyword arguments of transformers' `generate` for `decoding`: no beams, the KV cache, `pad`
    for finished rows, `eos` (empty: the model's generation_config decides) and the stop strings; with
    `logprobs` the raw logits of every step come back (`output_logits`); greedy unless
    `decoding.do_sample`. `full_length` and `synced` as in `generate_batch`."""
    kwargs: dict[str, Any] = {
        "max_new_tokens": decoding.max_new_tokens,
        "do_sample": decoding.do_sample,
        "num_beams": 1,
        "pad_token_id": pad,
        "use_cache": True,
    }
    if full_length:
        # no eos (the model's generation_config would stop a row at its own), and not synced:
        # transformers would turn that on by itself for an FSDP model
        kwargs.update(eos_token_id=None, synced_gpus=False)
    else:
        if eos:
            kwargs["eos_token_id"] = eos
        if synced:
            kwargs["synced_gpus"] = True
        if decoding.stop:
            kwargs.update(stop_strings=list(decoding.stop), tokenizer=tokenizer)
    if logprobs:
        kwargs.update(output_logits=True, return_dict_in_generate=True)
    if decoding.do_sample:
        kwargs.update(temperature=decoding.temperature, top_p=decoding.top_p, top_k=decoding.top_k)
    else:  # whatever sampling settings the model's generation_config carries do not apply
        kwargs.update(temperature=None, top_p=None, top_k=None)
    return kwargs


def generate_batch(
    model: Any,
    tokenizer: Any,
    batch: list[Prompt],
    decoding: Decoding,
    device: Any,
    synced: bool = False,
    autocast: Callable[[], Any] = contextlib.nullcontext,
    full_length: bool = False,
    logprobs: bool = False,
) -> list[dict[str, Any]]:
    """One left-padded batch through `model.generate` with the KV cache: a row per prompt
    ({"index", "completion", "tokens", "seconds", "ids", "logprobs", "stopped"}, seconds being the
    batch's; `logprobs`: each generated token's log-probability under the model's raw logits, else None).
    `full_length`: decode all `max_new_tokens` steps (no stop at the end-of-sequence token; each
    completion is still cut at its first one), the same forward passes whatever the prompts, with
    no synced decoding (`synced` is then moot)."""
    import torch

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(p.ids) for p in batch)
    ids = torch.tensor([[pad] * (width - len(p.ids)) + p.ids for p in batch], device=device)
    mask = torch.tensor(
        [[0] * (width - len(p.ids)) + [1] * len(p.ids) for p in batch], device=device
    )
    eos = _eos_ids(model, tokenizer) + list(decoding.stop_token_ids)
    kwargs = generate_kwargs(
        decoding, pad, eos, tokenizer, synced=synced, full_length=full_length, logprobs=logprobs
    )
    # a batch's draws depend only on the seed and which prompts it holds, not on the rank
    seed = hash((decoding.seed, tuple(p.index for p in batch))) % (2**63)
    t0 = time.perf_counter()
    with own_rng(seed, device), torch.no_grad(), autocast():
        out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        scores = None
        if logprobs:
            # (batch, new tokens, vocab): the raw logits of every step, not the sampling's warped ones
            steps = torch.stack(out.logits, dim=1).float().log_softmax(-1)
            out = out.sequences
            scores = steps.gather(-1, out[:, width:].unsqueeze(-1)).squeeze(-1).tolist()
    seconds = time.perf_counter() - t0
    rows = []
    for j, p in enumerate(batch):
        new = out[j, width:].tolist()
        # finished rows are padded after their eos; the eos is generated, and counted
        n, stopped = cut(new, eos, decoding.stop, tokenizer)
        rows.append(
            {
                "index": p.index,
                "completion": decode_completion(tokenizer, new[:n]),
                "tokens": n,
                "seconds": seconds,
                "ids": new[:n],  # the token ids themselves (GRPO trains on them)
                "logprobs": scores[j][:n] if scores is not None else None,
                "stopped": stopped,
            }
        )
    return rows


def generate_across(
    model: Any,
    tokenizer: Any,
    prompts: list[Prompt],
    d: Any,
    decoding: Decoding,
    synced: bool = False,
    autocast: Callable[[], Any] = contextlib.nullcontext,
    engine: Any = None,
) -> list[dict[str, Any]] | None:
    """Every prompt's completion, generated across the ranks of `d` (a `Dist`); on rank 0 the rows in
    prompt order ({"index", "prompt", "completion", "reference", "tokens", "seconds"}), None elsewhere.
    Every rank must call it. `synced`: the model is sharded, so every rank runs the same batches.
    `engine`: a `nbtrain.generation.engines` engine to generate with (default: transformers' on `model`);
    one that batches by itself (vLLM) gets all of this rank's prompts at once."""
    size = decoding.batch_size if engine is None or engine.name == "hf" else max(1, len(prompts))
    batches = deal(prompts, d.rank, d.world, size)
    n_batches = len(batches)
    if synced:
        n_batches = -d.min_int(-n_batches)
    # transformers' synced_gpus all-reduces over the default group: on a sub-group, full length
    full_length = synced and d.world < d.dist.get_world_size()
    rows: list[dict[str, Any]] = []
    # an interrupt is held to a batch's end; the ranks then meet where they would anyway (each
    # batch's check when synced, else the final gather) and stop together, none left in a collective
    failed: str | None = None
    error: Exception | None = None
    with interrupts.Held() as held:
        try:
            for b in range(n_batches):
                if synced and -d.min_int(-int(held.flag())) > 0:
                    break
                if not synced and held.pending:
                    break
                # a rank short of batches repeats one prompt, so its forward passes match the others'
                batch = batches[b] if b < len(batches) else [prompts[0]]
                got = (
                    generate_batch(
                        model,
                        tokenizer,
                        batch,
                        decoding,
                        d.device,
                        synced,
                        autocast,
                        full_length=full_length,
                    )
                    if engine is None
                    else engine.rows(batch, decoding)
                )
                if b < len(batches):
                    rows += got
        except Exception as e:
            if engine is None:
                raise
            # an engine of its own (vLLM) failed on this rank: the others hear of it at the gather
            # below instead of waiting there for this rank
            failed = str(e)
            error = e
        every = d.gather_objects((rows, held.flag(), failed, d.host))
    if error is not None:
        raise error
    for r, (_, _, text, host) in enumerate(every):
        if text is not None:
            first = text.splitlines()[0]
            msg = f"generation failed on rank {r} ({host}): {first}; see that rank's error for its log"
            raise EngineFailedElsewhere(msg)
    interrupts.stop_if_any([f for _, f, _, _ in every], "the end of a generate batch")
    every = [part for part, _, _, _ in every]
    if not d.is_zero:
        return None
    by_index = {r["index"]: r for part in every for r in part}
    return [
        {
            "index": p.index,
            "prompt": p.prompt,
            "completion": by_index[p.index]["completion"],
            "reference": p.reference,
            "tokens": by_index[p.index]["tokens"],
            "seconds": by_index[p.index]["seconds"],
        }
        for p in prompts
    ]
