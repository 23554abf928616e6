"""The model a run trains: the base loaded as `cfg.shard` and `cfg.load_in_4bit` ask (whole on every
rank, sharded with FSDP2, or quantised), Liger's kernels where they apply, and LoRA on top."""

from __future__ import annotations

import logging
from typing import Any

from nbtrain.configs.sft import SFTConfig
from nbtrain.engine.dist import Dist
from nbtrain.errors import ConfigError
from nbtrain.model import quant, shard, speed

log = logging.getLogger(__name__)


def build_model(
    cfg: SFTConfig, d: Dist, mesh: Any, weights_dtype: Any, compute_dtype: Any
) -> tuple[Any, list[str], list[str]]:
    """(the peft model on this rank, notes to print, speed levers used)."""
    import torch

    from nbtrain.model.pretrained import apply_lora, load_model

    notes: list[str] = []
    levers: list[str] = []

    def prepare(base: Any) -> None:
        if d.device.type == "cuda" and cfg.use_liger_kernel and not cfg.torch_compile:
            why_not = speed.apply_liger(base)
            if why_not is None:
                levers.append("liger")
            elif cfg.use_liger_kernel is True:
                raise ConfigError(f"use_liger_kernel=True, but {why_not.split(': ', 1)[1]}")
            else:
                notes.append(why_not)
        elif d.device.type == "cuda" and cfg.use_liger_kernel is True:
            # seen on an H100: dynamo fails to trace Liger's RMSNorm kernel, and compile fuses the same work
            notes.append("use_liger_kernel off: torch_compile fuses what Liger's kernels would")

    if cfg.shard != "ddp":
        model = shard.build_sharded(cfg, d, mesh, weights_dtype, compute_dtype, prepare)
        levers.append(f"{cfg.shard} over {d.world} rank(s)")
    else:
        if quant.quantized(cfg):
            base = quant.load_quantized(cfg, d.device, compute_dtype)
        else:
            base = load_model(cfg.model, weights_dtype, d.device, cfg.gradient_checkpointing)
        prepare(base)
        # same LoRA init on every rank and world size
        torch.manual_seed(cfg.seed)
        model = apply_lora(base, cfg)
    if quant.quantized(cfg):
        levers.append("4-bit NF4 base" if cfg.load_in_4bit else "8-bit base")
    if compute_dtype is not None and speed.skip_lora_input_cast(model):
        levers.append("bf16 lora inputs")
    return model, notes, levers


def compute_dtype(cfg: SFTConfig, device: Any) -> Any:
    import torch

    if cfg.dtype == "float32":
        return None
    if cfg.dtype == "bfloat16":
        return torch.bfloat16
    if device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False):
        return torch.bfloat16
    return None  # fp32 on CPU
