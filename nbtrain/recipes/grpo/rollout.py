"""GRPO's rollouts: the prompt rows and their order, `num_generations` sampled completions per prompt
(nbtrain's own generation, `nbtrain.generation.decode`: left padding, the KV cache, a seeded generator), the
reward functions called with TRL's signature, and the step's rewards turned into advantages.

A step's completions are numbered in prompt order (prompt p's g-th is p * num_generations + g), so that
the k-th of R ranks generates and trains completions [k N / R, (k + 1) N / R), TRL's process slice, and
a completion's draws depend on its number and the step, not on the rank that drew it.

The completions come from transformers' `generate` on the live model (`engine="hf"`, the reference), or
from a vLLM engine beside the rank (`engine="vllm"`, `nbtrain.generation.engines`): the rank's one
kept engine (`vllm_engine.kept`, which `generate` and samples use too), started once and reused by the
runs and calls after it on the same base, dtype and room for the LoRA (starting one takes 70-90 s on
a CPU), given the model's current adapter in memory before each step's sampling (so after each
optimizer step), and on a GPU woken for the sampling and put to sleep for the training after it.

A reward function that raises is named with the data row it failed on and the rank it ran on
(`RewardFunctionError`); every rank of the run raises with it, so none waits for the others.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

from nbtrain.data.prompts import Entry
from nbtrain.errors import ConfigError
from nbtrain.generation import decode
from nbtrain.losses.grpo import advantages, nanstd

log = logging.getLogger(__name__)

_ACCEPTED = "a 'prompt' (a string or a list of {'role', 'content'} messages) and any other columns"


class RewardFunctionError(RuntimeError):
    """A reward function raised, or returned something that is not one number per completion."""


@dataclass
class PromptRows:
    """The prompt rows of a run: each one's prompt, its other columns (for the reward functions), and
    its token ids (a string as training tokenizes text, messages through the chat template with the
    generation prompt)."""

    prompts: list[Any]
    columns: list[dict[str, Any]]
    ids: list[list[int]]
    where: list[str]

    @classmethod
    def read(cls, data: Any, tokenizer: Any, template_kwargs: dict | None = None) -> PromptRows:
        from nbtrain.data.sources import Source

        src = data if isinstance(data, Source) else Source(data, "data")
        rows = [(r.value, src.row_where(r)) for r in src.part(0, 1)]
        prompts, columns, where, entries = [], [], [], []
        bad: list[tuple[str, str]] = []
        for i, (value, at) in enumerate(rows):
            p = value.get("prompt") if isinstance(value, dict) else None
            ok = isinstance(p, str) or (
                isinstance(p, list)
                and bool(p)
                and all(isinstance(m, dict) and "role" in m for m in p)
            )
            if not ok:
                keys = (
                    "keys " + ", ".join(repr(k) for k in value)
                    if isinstance(value, dict)
                    else f"a {type(value).__name__}"
                )
                bad.append((f"data row {i}" + (f" ({at})" if at != "data" else ""), keys))
                continue
            prompts.append(p)
            columns.append(
                {k: v for k, v in value.items() if k not in ("completion", "completion_ids")}
            )
            where.append(at)
            entries.append(Entry(p, None, value.get("tools"), value.get("chat_template_kwargs")))
        if bad:
            raise ConfigError(_bad_rows(bad, len(rows)))
        if not prompts:
            msg = f"data holds no prompt rows; give rows with {_ACCEPTED}"
            raise ConfigError(msg)
        try:
            encoded = decode.encode(entries, tokenizer, template_kwargs)
        except ConfigError as e:
            msg = f"data: {e}"
            raise ConfigError(msg) from None
        return cls(prompts, columns, [p.ids for p in encoded], where)

    def __len__(self) -> int:
        return len(self.prompts)


def _bad_rows(bad: list[tuple[str, str]], n: int) -> str:
    """The rows that are not prompt rows, in one message: one line when they all fail alike."""
    kinds = {keys for _, keys in bad}
    if len(bad) == n and len(kinds) == 1:
        return f"all {n} rows of data have {bad[0][1]}, and a GRPO row needs {_ACCEPTED}"
    shown = "; ".join(f"{at} has {keys}" for at, keys in bad[:5])
    more = f"; and {len(bad) - 5} more" if len(bad) > 5 else ""
    return f"{len(bad)} of {n} data rows are not GRPO prompt rows: {shown}{more}. Each row needs {_ACCEPTED}"


@dataclass
class PromptOrder:
    """Which prompts each step takes: a seeded shuffle per epoch, `per_step` prompts a step (an
    epoch's remainder is left out, as a dataloader's last partial batch would be)."""

    n: int
    per_step: int
    seed: int

    @property
    def steps_per_epoch(self) -> int:
        return max(1, self.n // self.per_step)

    def step(self, data_step: int) -> list[int]:
        import numpy as np

        epoch, k = divmod(data_step, self.steps_per_epoch)
        order = np.random.default_rng(self.seed + epoch).permutation(self.n).tolist()
        if self.n < self.per_step:  # fewer prompts than a step takes: repeat the shuffled set
            order = (order * math.ceil(self.per_step / self.n))[: self.per_step]
        return [int(i) for i in order[k * self.per_step : (k + 1) * self.per_step]]


@dataclass
class Part:
    """One rank's share of a step's completions, as generated and scored there."""

    first: int  #: the number of its first completion in the step
    prompt_index: list[int]  #: each completion's data row
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    texts: list[str]
    truncated: list[bool]
    rewards: list[list[float]] = field(
        default_factory=list
    )  #: [completion][function], NaN for None
    seconds: float = 0.0  #: generating and scoring it
    #: disaggregated: each completion's token log-probabilities under the adapter that sampled it
    old_logps: list[list[float]] | None = None


def share(n: int, k: int, parts: int) -> tuple[int, int]:
    """Completions [start, end) of the step's `n` that part `k` of `parts` takes."""
    return n * k // parts, n * (k + 1) // parts


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    found = set(eos if isinstance(eos, list | tuple) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        found.add(tokenizer.eos_token_id)
    return found


@dataclass
class RolloutDecoding(decode.Decoding):
    """GRPO's decoding with the engine that samples: None, transformers' `generate` on the live model;
    else a `nbtrain.generation.engines` engine (vLLM), given the model's adapter before it samples."""

    engine: Any = None


def lora_spec(peft_model: Any) -> Any:
    """The LoRA shape vLLM must be started for (rank, alpha, target modules), read off the peft model."""
    from nbtrain.generation import engines

    pc = peft_model.peft_config["default"]
    targets = pc.target_modules
    names = sorted(targets) if isinstance(targets, set | list | tuple) else [str(targets)]
    return engines.LoraSpec(r=int(pc.r), alpha=float(pc.lora_alpha), target_modules=names)


def rollout_engine(
    model_path: str, tokenizer: Any, peft_model: Any, d: Any, dtype: Any = None
) -> Any:
    """This rank's vLLM engine for GRPO's rollouts, on `model_path`'s base with room for the peft
    model's LoRA, computing in `dtype` (the training's compute dtype; None: the weights' own): the
    rank's kept engine (`vllm_engine.kept`, shared with `generate` and samples) where it was started
    for all of these (a start costs 70-90 s on a CPU), else a new one, the old one ended first: one
    vLLM a rank, which on a GPU shares its memory with training."""
    from nbtrain.generation import engines, vllm_engine

    options = engines.VLLMOptions(dtype="auto" if dtype is None else str(dtype).split(".")[-1])
    return vllm_engine.kept(
        str(model_path), tokenizer, d.device, lora_spec(peft_model), d.rank, d.host, options
    )


def _engine_rows(
    engine: Any, model: Any, todo: list[decode.Prompt], decoding: decode.Decoding
) -> dict[int, list[int]]:
    """The prompts' completions from `engine`, all at once (it batches by itself), with the model's
    adapter as it is now; on a GPU the engine is awake for this alone."""
    from dataclasses import fields

    plain = decode.Decoding(**{f.name: getattr(decoding, f.name) for f in fields(decode.Decoding)})
    engine.wake()
    try:
        engine.set_adapter(model)
        out = engine.generate(todo, plain)
    finally:
        engine.sleep()  # the GPU's memory back to training (nothing on a CPU)
    return {c.index: list(c.ids) for c in out}


def generate_part(
    model: Any,
    tokenizer: Any,
    rows: PromptRows,
    step_prompts: list[int],
    group: int,
    span: tuple[int, int],
    decoding: decode.Decoding,
    device: Any,
    autocast: Any,
) -> Part:
    """Completions `span` of the step (prompt `step_prompts[c // group]` for completion c), sampled in
    batches of `decoding.batch_size` from `model` in eval mode (train mode put back after), or, where
    `decoding` carries an engine (`RolloutDecoding`), all at once by that engine with `model`'s adapter."""
    start, end = span
    todo = [
        decode.Prompt(c, rows.prompts[step_prompts[c // group]], rows.ids[step_prompts[c // group]])
        for c in range(start, end)
    ]
    t0 = time.perf_counter()
    engine = getattr(decoding, "engine", None)
    got: dict[int, list[int]] = {}
    if engine is not None:
        got = _engine_rows(engine, model, todo, decoding)
    else:
        with decode.generation_mode(model):
            size = decoding.batch_size
            for b in range(0, len(todo), size):
                out = decode.generate_batch(
                    model, tokenizer, todo[b : b + size], decoding, device, False, autocast
                )
                got.update({r["index"]: list(r["ids"]) for r in out})
    eos = eos_ids(model, tokenizer) | {tokenizer.pad_token_id}
    completion_ids = [got[p.index] for p in todo]
    return Part(
        first=start,
        prompt_index=[step_prompts[c // group] for c in range(start, end)],
        prompt_ids=[p.ids for p in todo],
        completion_ids=completion_ids,
        texts=tokenizer.batch_decode(completion_ids, skip_special_tokens=True),
        truncated=[not ids or ids[-1] not in eos for ids in completion_ids],
        seconds=time.perf_counter() - t0,
    )


def _call(fn: Any, name: str, rows: PromptRows, part: Part, idx: list[int]) -> list[Any]:
    prompts = [rows.prompts[part.prompt_index[i]] for i in idx]
    completions: list[Any] = [
        part.texts[i]
        if isinstance(prompts[k], str)
        else [{"role": "assistant", "content": part.texts[i]}]
        for k, i in enumerate(idx)
    ]
    keys = [k for k in rows.columns[part.prompt_index[idx[0]]] if k != "prompt"] if idx else []
    columns = {k: [rows.columns[part.prompt_index[i]].get(k) for i in idx] for k in keys}
    return list(
        fn(
            prompts=prompts,
            completions=completions,
            completion_ids=[part.completion_ids[i] for i in idx],
            **columns,
        )
    )


def score_part(
    funcs: list[Any], names: list[str], rows: PromptRows, part: Part, rank: int, host: str
) -> None:
    """Each reward function on the part's completions, as TRL calls it: f(prompts=, completions=,
    completion_ids=, **the rows' other columns) -> one float or None per completion (None is NaN).

    A function that raises is called again row by row to find the row it fails on, and a
    `RewardFunctionError` names both, and this rank."""
    t0 = time.perf_counter()
    n = len(part.texts)
    table = [[math.nan] * len(funcs) for _ in range(n)]
    for j, (fn, name) in enumerate(zip(funcs, names, strict=True)):
        try:
            values = _call(fn, name, rows, part, list(range(n)))
        except Exception as e:
            raise _failed(fn, name, rows, part, rank, host, e) from e
        if len(values) != n:
            msg = (
                f"reward function {name!r} returned {len(values)} rewards for {n} completions on rank "
                f"{rank} ({host}); return one number (or None) per completion"
            )
            raise RewardFunctionError(msg)
        for i, v in enumerate(values):
            if v is None:
                continue
            try:
                table[i][j] = float(v)
            except (TypeError, ValueError):
                msg = (
                    f"reward function {name!r} returned {v!r} for {_row(rows, part.prompt_index[i])} on "
                    f"rank {rank} ({host}); return a number or None per completion"
                )
                raise RewardFunctionError(msg) from None
    part.rewards = table
    part.seconds += time.perf_counter() - t0


def _row(rows: PromptRows, row: int) -> str:
    at = rows.where[row]
    return f"data row {row}" + (f" ({at})" if at != "data" else "")


def _failed(
    fn: Any, name: str, rows: PromptRows, part: Part, rank: int, host: str, err: Exception
) -> Exception:
    bad = None
    for i in range(len(part.texts)):
        try:
            _call(fn, name, rows, part, [i])
        except Exception as e:  # the first row it fails on alone
            bad, err = i, e
            break
    where = "its batch (no single row fails alone)"
    if bad is not None:
        where = f"{_row(rows, part.prompt_index[bad])}, completion {part.texts[bad][:80]!r}"
    msg = f"reward function {name!r} raised {type(err).__name__}: {err} on rank {rank} ({host}), for {where}"
    return RewardFunctionError(msg)


@dataclass
class Scored:
    """A step's completions, all ranks' parts in completion order, with advantages and metrics."""

    parts: list[Part]
    advantages: list[float]
    metrics: dict[str, float]


def finish(
    parts: list[Part], names: list[str], weights: list[float], group: int, scale: str
) -> Scored:
    """Advantages over the whole step (groups may span parts, as TRL's do across processes), and the
    rollout's metrics under TRL's names."""
    import torch

    rewards_per_func = torch.tensor([r for p in parts for r in p.rewards], dtype=torch.float32)
    adv, rewards = advantages(rewards_per_func, weights, group, scale)
    lengths = torch.tensor([len(c) for p in parts for c in p.completion_ids], dtype=torch.float32)
    truncated = torch.tensor([t for p in parts for t in p.truncated], dtype=torch.float32)
    grouped_std = nanstd(rewards.view(-1, group), dim=1)
    metrics = {
        "reward": float(torch.nanmean(rewards)),
        "reward_std": float(nanstd(rewards)),
        "frac_reward_zero_std": float(
            torch.isclose(grouped_std, torch.zeros_like(grouped_std)).float().mean()
        ),
        "completions/mean_length": float(lengths.mean()),
        "completions/clipped_ratio": float(truncated.mean()),
    }
    for j, name in enumerate(names):
        metrics[f"rewards/{name}/mean"] = float(torch.nanmean(rewards_per_func[:, j]))
        metrics[f"rewards/{name}/std"] = float(nanstd(rewards_per_func[:, j]))
    return Scored(parts, adv.tolist(), metrics)


def collate(
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    adv: list[float],
    truncated: list[bool],
    pad_id: int,
    mask_truncated: bool,
) -> dict[str, Any]:
    """A micro-batch as TRL lays it out: prompts left-padded, completions right-padded, their masks,
    the advantages, and the loss mask (a truncated completion's zeroed with `mask_truncated`)."""
    import torch

    pw = max(len(p) for p in prompt_ids)
    cw = max(max(len(c) for c in completion_ids), 1)
    pids = torch.tensor([[pad_id] * (pw - len(p)) + p for p in prompt_ids])
    pmask = torch.tensor([[0] * (pw - len(p)) + [1] * len(p) for p in prompt_ids])
    cids = torch.tensor([c + [pad_id] * (cw - len(c)) for c in completion_ids])
    cmask = torch.tensor([[1] * len(c) + [0] * (cw - len(c)) for c in completion_ids])
    if mask_truncated:
        keep = torch.tensor([0 if t else 1 for t in truncated]).unsqueeze(1)
        cmask = cmask * keep
    return {
        "prompt_ids": pids,
        "prompt_mask": pmask,
        "completion_ids": cids,
        "completion_mask": cmask,
        "loss_mask": cmask,
        "advantages": torch.tensor(adv, dtype=torch.float32),
    }
