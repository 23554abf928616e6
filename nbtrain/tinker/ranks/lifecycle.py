"""`create_model`, `unload` and `status` of the Tinker service: the models this process holds."""

from __future__ import annotations

import logging
from typing import Any

from nbtrain.tinker.ranks import registry

log = logging.getLogger(__name__)


def create_model(model_id: str, base_model: str, lora: dict[str, Any]) -> dict[str, Any]:
    """A LoRA model `model_id` on `base_model` (loaded once per process), with its own AdamW.

    `lora`: {"rank", "seed", "train_mlp", "train_attn", "train_unembed"} (Tinker's LoraConfig).
    """
    import random

    lora = registry.check_lora(lora)
    d = registry.dist()
    seed = lora["seed"]
    if seed is None:  # one random seed for every rank, so that their adapters start equal
        seed = d.broadcast_object(random.SystemRandom().randrange(2**31))
    existed = model_id in registry.MODELS
    try:
        registry.exchange(d, lambda: registry.create(model_id, base_model, lora, seed))
    except Exception:
        if (
            not existed and model_id in registry.MODELS
        ):  # made here, not on every rank: none keeps it
            registry.unload(model_id)
        raise
    trainee = registry.get(model_id)
    return {
        "model_id": model_id,
        "base_model": base_model,
        "model_name": base_model,
        "tokenizer_id": base_model,
        "lora_rank": trainee.lora["rank"],
        "is_lora": True,
        "memory_bytes": registry.memory_bytes(trainee),
    }


def unload(model_id: str) -> None:
    """Drop `model_id`: its adapter, gradients and optimizer state (the base when no model is left on it)."""
    registry.unload(model_id)


def status() -> list[dict[str, Any]]:
    """One row per live model: {"model_id", "base_model", "lora_rank", "steps", "memory_bytes" (the
    adapter, its gradients and AdamW state), "base_memory_bytes" (shared by the models on that base),
    "device"}."""
    return [
        {
            "model_id": t.model_id,
            "base_model": t.base.name,
            "lora_rank": t.lora["rank"],
            "steps": t.steps,
            "memory_bytes": registry.memory_bytes(t),
            "base_memory_bytes": registry.base_bytes(t.base),
            "device": str(t.base.device),
        }
        for t in registry.MODELS.values()
    ]
