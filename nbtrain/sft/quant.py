"""QLoRA: the frozen base in 4-bit NF4 (or 8-bit) through bitsandbytes, LoRA on top in bf16/fp32.

The recipe is peft's and transformers': `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)`, then
`prepare_model_for_kbit_training` (norms in fp32, input grads on for checkpointing). The adapter trained
on a 4-bit base is an ordinary LoRA adapter: it loads on the unquantised base. Merging it into 4-bit
weights would round the merged weights to 4 bits, so `merge=True` merges into a bf16 copy of the base
loaded on rank 0's CPU instead (`nbtrain.sft.checkpoint.export_merged_from_adapter`).
"""

from __future__ import annotations

import importlib.util
from typing import Any

from nbtrain.errors import ConfigError


def quantized(cfg: Any) -> bool:
    return bool(cfg.load_in_4bit or cfg.load_in_8bit)


def check_quant(cfg: Any, device: Any, rank: int, host: str) -> None:
    """A ConfigError, before any step, where this rank cannot load the base quantised."""
    if not quantized(cfg):
        return
    what = "load_in_4bit" if cfg.load_in_4bit else "load_in_8bit"
    if device.type != "cuda":
        msg = (
            f"{what}=True needs a CUDA GPU (bitsandbytes' kernels), and rank {rank} on {host} trains on "
            f"{device.type}; drop {what} to train in {'fp32' if device.type == 'cpu' else 'bf16'}, or run "
            "on GPU ranks"
        )
        raise ConfigError(msg)
    if importlib.util.find_spec("bitsandbytes") is None:
        msg = (
            f"{what}=True needs bitsandbytes, which is not installed on rank {rank} on {host}; "
            "pip install 'nbtrain[qlora]' (bitsandbytes) on every node, or drop "
            f"{what}"
        )
        raise ConfigError(msg)


def bnb_config(cfg: Any, compute_dtype: Any, sharded: bool = False) -> Any:
    """peft's QLoRA quantisation settings: NF4, double quantisation, bf16 compute.

    `sharded`: 4-bit weights stored as bf16 words (`bnb_4bit_quant_storage`), the dtype FSDP can shard;
    nbtrain refuses QLoRA with FSDP2 for now (see nbtrain.sft.shard.check_shard), so this is for the
    day fully_shard keeps Params4bit's quant_state.
    """
    import torch
    from transformers import BitsAndBytesConfig

    if cfg.load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    kwargs: dict[str, Any] = {}
    if sharded:
        kwargs["bnb_4bit_quant_storage"] = torch.bfloat16
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype or torch.bfloat16,
        **kwargs,
    )


def load_quantized(cfg: Any, device: Any, compute_dtype: Any) -> Any:
    """The base model quantised onto this rank's GPU, prepared for k-bit training."""
    import torch
    from peft import prepare_model_for_kbit_training

    from nbtrain.sft.model import load_model

    base = load_model(
        cfg.model,
        compute_dtype or torch.bfloat16,
        device,
        quantization_config=bnb_config(cfg, compute_dtype),
        device_map={"": device},
    )
    return prepare_model_for_kbit_training(
        base,
        use_gradient_checkpointing=cfg.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )
