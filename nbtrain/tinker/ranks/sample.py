"""`sample` of the Tinker service (and `compute_logprobs`, which is a sample of one token with the
prompt's log-probabilities), run on every rank with the same arguments.

The samples are split across the ranks (sample i on rank i % world), each rank decodes its share in one
batch through transformers' `generate` with the KV cache (as `nbtrain.generation.decode` does), inside
its own seeded generator (`decode.own_rng`: the seed and the rank, so a seed gives the same samples
again on the same number of ranks), and the sequences are gathered to every rank in order.
A sequence's tokens include the stop token (or the tokens that complete a stop string); its logprobs are
the sampled tokens' log-probabilities under the sampled weights, from the model's unprocessed logits
(temperature 1, no top-k or top-p), as the learner computes them in `forward`.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nbtrain.errors import ConfigError
from nbtrain.generation.decode import Decoding, generate_kwargs, own_rng
from nbtrain.tinker.ranks import registry, state

log = logging.getLogger(__name__)


def check_params(params: dict[str, Any]) -> dict[str, Any]:
    """Tinker's SamplingParams with its defaults, checked."""
    out: dict[str, Any] = {
        "max_tokens": 64,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "seed": None,
        "stop": None,
    }
    out.update({k: v for k, v in params.items() if v is not None or k == "stop"})
    problems = []
    mt = out["max_tokens"]
    if not (isinstance(mt, int) and not isinstance(mt, bool) and mt >= 1):
        problems.append(f"max_tokens={mt!r} must be an integer >= 1")
    if not (isinstance(out["temperature"], int | float) and out["temperature"] >= 0):
        problems.append(f"temperature={out['temperature']!r} must be >= 0 (0: greedy)")
    if not (isinstance(out["top_p"], int | float) and 0 < out["top_p"] <= 1):
        problems.append(f"top_p={out['top_p']!r} must be in (0, 1]")
    if not (isinstance(out["top_k"], int) and (out["top_k"] == -1 or out["top_k"] >= 1)):
        problems.append(f"top_k={out['top_k']!r} must be -1 (no cut) or an integer >= 1")
    stop = out["stop"]
    if stop is not None:
        if isinstance(stop, str | int):
            stop = [stop]
        if not (all(isinstance(s, str) for s in stop) or all(isinstance(s, int) for s in stop)):
            problems.append(f"stop={stop!r} must be a list of strings or a list of token ids")
        out["stop"] = list(stop)
    if problems:
        raise ConfigError("sampling_params: " + "; ".join(problems))
    return out


@contextlib.contextmanager
def _weights(source: dict[str, Any]) -> Iterator[registry.Base]:
    """The base model with the weights `source` names active (see `sample`)."""
    from peft import PeftModel

    if "sampler_id" in source:
        sid = source["sampler_id"]
        if sid not in registry.SNAPSHOTS:
            msg = (
                f"this service holds no sampler {sid!r} (it keeps the last {registry.MAX_SNAPSHOTS} "
                "ephemeral ones); save the weights for sampling again"
            )
            raise registry.UnknownModelError(msg)
        snap = registry.SNAPSHOTS[sid]
        base = registry.get_base(snap.base_name)
        state.load_slot(base, snap.lora, snap.tensors, snap.serial)
        yield base
    elif "model_id" in source:
        trainee = registry.get(source["model_id"])
        with registry.active(trainee):
            yield trainee.base
    elif "path" in source:
        lora, tensors, base_name = state.read_adapter(Path(source["path"]))
        base = registry.get_base(source.get("base_model") or base_name)
        state.load_slot(base, lora, tensors)
        yield base
    elif "base_model" in source:
        base = registry.get_base(source["base_model"])
        if isinstance(base.model, PeftModel):
            with base.model.disable_adapter():
                yield base
        else:
            yield base
    else:
        msg = f"sample source {source!r} names no sampler_id, model_id, path or base_model"
        raise ConfigError(msg)


def _stop_ids(p: dict[str, Any], tokenizer: Any, model: Any) -> list[int]:
    if p["stop"] is None:  # the model's end of sequence
        eos = getattr(model.generation_config, "eos_token_id", None) or tokenizer.eos_token_id
        return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    if p["stop"] and isinstance(p["stop"][0], int):
        return list(p["stop"])
    # stop strings: the end of sequence stops a sample too (nothing sensible follows it)
    return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []


def _cut(new: list[int], stop_ids: list[int], strings: list[str], tokenizer: Any) -> int | None:
    """How many of `new` to keep: up to and including the first stop token or the token that completes
    a stop string; None when neither occurs."""
    # a stop string of L characters spans at most 4L tokens (a byte-level token holds one byte at
    # least), so only that tail is decoded at each position, not the whole prefix
    window = 4 * max((len(s) for s in strings), default=0) + 2
    for k, t in enumerate(new):
        if t in stop_ids:
            return k + 1
        if strings:
            text = tokenizer.decode(new[max(0, k + 1 - window) : k + 1])
            if any(s in text for s in strings):
                return k + 1
    return None


def _topk(logp: Any, k: int) -> list[list[tuple[int, float]]]:
    """The k most likely tokens at each row of `logp` (positions, vocab): [(token_id, logprob)]
    from the most likely down, as `torch.topk` orders them."""
    import torch

    values, ids = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
    return [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]


def _prompt_logprobs(
    model: Any, prompt: list[int], device: Any, topk: int = 0
) -> tuple[list[float | None], list[list[tuple[int, float]] | None] | None]:
    """log p(prompt[i] | prompt[:i]) for every i (None for the first: nothing predicts it), and the
    `topk` most likely tokens at every position (None for the first; None for all when topk is 0)."""
    import torch

    ids = torch.as_tensor([prompt], dtype=torch.long, device=device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()[0]
    logp = torch.log_softmax(logits[:-1], dim=-1)
    lp = logp.gather(-1, ids[0, 1:, None]).squeeze(-1)
    top: list[list[tuple[int, float]] | None] | None = (
        [None, *_topk(logp.cpu(), topk)] if topk > 0 else None
    )
    return [None, *(float(x) for x in lp.cpu())], top


def _decode_share(
    base: registry.Base, prompt: list[int], n: int, p: dict[str, Any], seed: int, topk: int = 0
) -> list[dict[str, Any]]:
    import torch

    model, tok = base.model, base.tokenizer
    stop_ids = _stop_ids(p, tok, model)
    strings = [s for s in (p["stop"] or []) if isinstance(s, str)]
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.as_tensor([prompt] * n, dtype=torch.long, device=base.device)
    greedy = p["temperature"] == 0
    decoding = Decoding(
        max_new_tokens=p["max_tokens"],
        do_sample=not greedy,
        temperature=float(p["temperature"]),
        top_p=float(p["top_p"]),
        top_k=p["top_k"] if p["top_k"] > 0 else 0,
        stop=tuple(strings),
    )
    kwargs = generate_kwargs(decoding, pad, stop_ids, tok, logprobs=True)
    # the caller's stop ids alone (none: None), even empty: the model's own end-of-sequence would stop
    # rows that the caller's `stop` lets go on
    kwargs["eos_token_id"] = stop_ids or None
    with own_rng(seed, base.device), torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
    steps = len(out.logits)
    logits = torch.stack([x.float() for x in out.logits], dim=1)  # (n, steps, vocab)
    new = out.sequences[:, len(prompt) : len(prompt) + steps]
    logp = torch.log_softmax(logits, dim=-1)
    lps = logp.gather(-1, new[..., None]).squeeze(-1)
    rows = []
    for j in range(n):
        toks = new[j].tolist()
        cut = _cut(toks, stop_ids, strings, tok)
        keep = cut if cut is not None else len(toks)
        rows.append(
            {
                "tokens": toks[:keep],
                "logprobs": [float(x) for x in lps[j, :keep].cpu()],
                "stop_reason": "stop" if cut is not None else "length",
            }
        )
        if topk > 0:
            rows[-1]["topk_logprobs"] = _topk(logp[j, :keep].cpu(), topk)
    return rows


def sample(
    source: dict[str, Any],
    prompt: list[int],
    num_samples: int,
    params: dict[str, Any],
    prompt_logprobs: bool = False,
    topk_prompt_logprobs: int = 0,
    topk_sample_logprobs: int = 0,
) -> dict[str, Any]:
    """`num_samples` completions of `prompt` (token ids) from the weights `source` names:
    {"sampler_id"} (a snapshot), {"model_id"} (a training model's current weights), {"path",
    "base_model"?} (a peft adapter folder) or {"base_model"} (no adapter). Returns, on every rank,
    {"sequences": [{"tokens", "logprobs", "stop_reason", "topk_logprobs"?}, ...], "prompt_logprobs":
    [...] | None, "topk_prompt_logprobs": [...] | None}. A top-k is, per position, the k most likely
    [(token_id, logprob)] of the unprocessed logits (as the logprobs), most likely first, k at most
    the vocabulary; the prompt's first position has None (nothing predicts it)."""
    p = check_params(params)
    if not prompt:
        raise ConfigError("the prompt has no tokens; give it at least one")
    if not (isinstance(num_samples, int) and num_samples >= 1):
        msg = f"num_samples={num_samples!r} must be an integer >= 1"
        raise ConfigError(msg)
    for name, k in (
        ("topk_prompt_logprobs", topk_prompt_logprobs),
        ("topk_sample_logprobs", topk_sample_logprobs),
    ):
        if not (isinstance(k, int) and not isinstance(k, bool) and k >= 0):
            msg = f"{name}={k!r} must be an integer >= 0 (0: none)"
            raise ConfigError(msg)
    d = registry.dist()
    # without a seed, one drawn on rank 0 for all: ranks whose generators were seeded alike for
    # training would otherwise draw the same samples
    seed = (
        p["seed"]
        if p["seed"] is not None
        else d.broadcast_object(random.SystemRandom().randrange(2**31))
    )
    mine = list(range(d.rank, num_samples, d.world))

    def local() -> tuple[list[tuple[int, dict[str, Any]]], Any, Any]:
        rows: list[tuple[int, dict[str, Any]]] = []
        plp = top = None
        with _weights(source) as base:
            if mine:
                rng = hash((seed, d.rank)) % (2**63)
                got = _decode_share(base, prompt, len(mine), p, rng, topk_sample_logprobs)
                rows = list(zip(mine, got))
            if (prompt_logprobs or topk_prompt_logprobs) and d.is_zero:
                plp, top = _prompt_logprobs(base.model, prompt, base.device, topk_prompt_logprobs)
        return rows, plp if prompt_logprobs else None, top

    gathered = registry.exchange(d, local)
    by_index = {i: r for part, _, _ in gathered for i, r in part}
    return {
        "sequences": [by_index[i] for i in range(num_samples)],
        "prompt_logprobs": gathered[0][1],
        "topk_prompt_logprobs": gathered[0][2],
    }
