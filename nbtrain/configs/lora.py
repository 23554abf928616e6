"""The LoRA settings' checks: rank scale, dropout, target modules and, on an MoE model, `lora_moe`
(what `nbtrain.model.targets` adapts beyond attention)."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

#: what lora_moe may name on an MoE model; the default is experts and shared experts, not the router
MOE_PARTS = ("experts", "shared_experts", "router")


def lora_problems(cfg: Any) -> list[str]:
    """What is wrong with `cfg`'s LoRA settings (normalising tuples to lists on the way)."""
    problems = []
    if not (isinstance(cfg.lora_alpha, int | float) and cfg.lora_alpha > 0):
        problems.append(f"lora_alpha={cfg.lora_alpha!r} must be > 0")
    if not (isinstance(cfg.lora_dropout, int | float) and 0 <= cfg.lora_dropout < 1):
        problems.append(f"lora_dropout={cfg.lora_dropout!r} must be in [0, 1)")
    tm = cfg.target_modules
    if not (
        (isinstance(tm, str) and bool(tm))
        or (isinstance(tm, list | tuple) and bool(tm) and all(isinstance(m, str) for m in tm))
    ):
        problems.append(
            f"target_modules={tm!r} must be 'all-linear' or a non-empty list of module names such as "
            "['q_proj', 'v_proj']"
        )
    elif isinstance(tm, tuple):
        cfg.target_modules = list(tm)
    moe, problem = moe_parts(cfg.lora_moe)
    if problem:
        problems.append(problem)
    else:
        cfg.lora_moe = moe
    return problems


def moe_parts(moe: Any) -> tuple[list[str], str | None]:
    """`lora_moe` (a part's name, or a list or tuple of them) as a list, and what is wrong with it
    (None when nothing): SFTConfig's check, and nbtrain.model.targets' for callers with no SFTConfig."""
    parts = [moe] if isinstance(moe, str) else moe
    if isinstance(parts, list | tuple) and all(p in MOE_PARTS for p in parts):
        return list(parts), None
    return [], f"lora_moe={moe!r}: name any of {', '.join(MOE_PARTS)}, or [] for attention only"
