"""Throughput levers for `finetune` on GPUs: each one optional, each one off with a one-line note where
it cannot apply.

Measured on one H100 with the Llama-3.1-8B shape (benchmarks/bench_gpu.py, benchmarks/RESULTS.md):
- bf16 LoRA without peft's input cast. peft keeps the adapter weights in fp32 (the optimizer's master
  copy) and casts every layer input to fp32 to match them, so each adapted layer copies its input to
  fp32 and runs fp32 GEMMs; under bf16 autocast the cast is pure overhead (autocast casts the small
  adapter weights to bf16 instead).
- Liger's Triton kernels for RMSNorm, SwiGLU and RoPE on the architectures Liger supports.
- `torch.compile` of each decoder layer (one graph, reused by every layer: compiles in seconds, fuses
  the elementwise work that Liger's kernels would otherwise do, so the two are not combined).
- The loss without logits (`nbtrain.losses.sft`).
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

log = logging.getLogger(__name__)


def liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def skip_lora_input_cast(model: Any) -> int:
    """Let every LoRA layer take its input in the compute dtype (bf16 under autocast), not its weights'.

    Returns how many layers were changed. Only call this when training runs under autocast: without
    it, an fp32 adapter would then get bf16 inputs and fail.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    count = 0
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.cast_input_dtype_enabled = False  # type: ignore[attr-defined]
            count += 1
    return count


def apply_liger(base: Any) -> str | None:
    """Liger's RMSNorm, SwiGLU and RoPE kernels on `base` (a transformers causal LM), in place.

    Returns None when applied, else why not (one line). The loss is nbtrain's own (`nbtrain.losses.sft`),
    so Liger's cross-entropy patches stay off. Liger patches the architecture's module in this process
    as well as the instance: later models of the same architecture in this process get the kernels too.
    """
    if not liger_available():
        return "Liger kernels off: liger-kernel is not installed (pip install 'nbtrain[gpu]')"
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    model_type = getattr(base.config, "model_type", None)
    apply_fn = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if apply_fn is None:
        return f"Liger kernels off: Liger has none for {model_type!r} models"
    import inspect

    wanted = {
        "rope": True,
        "rms_norm": True,
        "swiglu": True,
        "geglu": True,
        "layer_norm": True,
        "cross_entropy": False,
        "fused_linear_cross_entropy": False,
    }
    params = inspect.signature(apply_fn).parameters
    apply_fn(model=base, **{k: v for k, v in wanted.items() if k in params})
    return None


def decoder_layers(base: Any) -> Any:
    """The list of transformer blocks of a transformers causal LM, or None where it cannot be found."""
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    for owner in (decoder, getattr(base, "model", None), getattr(base, "transformer", None)):
        for name in ("layers", "h", "blocks"):
            layers = getattr(owner, name, None) if owner is not None else None
            if layers is not None and len(layers) > 0:
                return layers
    return None


def compile_layers(base: Any) -> str | None:
    """`torch.compile` each transformer block in place; None when done, else why not (one line)."""
    layers = decoder_layers(base)
    if layers is None:
        return f"torch_compile off: no list of transformer blocks found in {type(base).__name__}"
    for layer in layers:
        layer.compile()
    return None
