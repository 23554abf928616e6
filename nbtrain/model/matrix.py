"""docs/models.md's family x path table, made from the model matrix so it cannot drift.

Each column is one test of tests/model/test_families.py, parametrized over every family of
`nbtrain.model.families.FAMILIES` (tests/model/test_families.py checks that each test named here
exists and runs on every family); a cell says what that test asserts of the family. The columns
with no matrix test yet name where else the path is tested, and say "not yet run" for the rest.

    python -m nbtrain.model.matrix            # rewrite the table in docs/models.md
    python -m nbtrain.model.matrix --check    # fail when it is stale (tests/test_docs.py)
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from nbtrain.doc_tables import GeneratedTable, cell
from nbtrain.model.families import FAMILIES

log = logging.getLogger(__name__)

COMMAND = "python -m nbtrain.model.matrix"
PAGE = Path(__file__).resolve().parents[2] / "docs" / "models.md"

#: column -> the matrix test that checks it on every family
TESTED: dict[str, str] = {
    "LoRA 'all-linear'": "test_all_linear_adapts_every_linear_layer_and_the_experts_not_the_router",
    "SFT + export": "test_sft_trains_and_its_adapter_loads_in_plain_peft_and_merges_equal",
    "DPO, GRPO": "test_a_dpo_and_a_grpo_run",
    "generate": "test_greedy_generate_equals_transformers",
    "nbtrain.Run": "test_run_in_two_spans_equals_one_run",
    "Tinker": "test_tinker_cross_entropy_is_the_weighted_logprob_sum_and_samples",
    "packing": "test_a_packed_row_keeps_its_documents_apart",
    "QLoRA (CPU)": "test_qlora_trains_on_a_4_bit_base",
}
#: columns not in the matrix yet: family -> what its test elsewhere says (others: not yet run)
_FSDP = "tests/model/test_shard_families.py"
ELSEWHERE: dict[str, dict[str, str]] = {
    "FSDP2": {
        "llama": "tested (tests/model/test_shard.py)",
        "qwen3_5": f"tested ({_FSDP})",
        "granite4": f"tested ({_FSDP})",
        "gpt_oss": f"tested, LoRA on the fused experts ({_FSDP})",
        "llama4": f"tested, LoRA on the fused experts ({_FSDP})",
        "qwen3_moe": f"tested, experts fused from one file entry each, with LoRA ({_FSDP})",
    },
}
_VLLM_TEST = "tests/generation/test_vllm_families.py"
#: the families tests/generation/test_vllm_families.py runs by default, one per distinct vLLM model
#: class among those vLLM's CPU build takes (NBTRAIN_VLLM_ALL_FAMILIES=1 runs every one it takes)
VLLM_TESTED = ("qwen3", "gemma3", "phi3", "granite4", "qwen3_moe", "gpt_oss")


#: the vLLM column's few words for a family it refuses (the refusal says the whole reason)
_VLLM_WHY = {
    "qwen3_5": "vLLM's Qwen3.5 code needs torchvision, which no CPU torch build here has",
    "qwen3_next": "its gated delta net CPU kernel takes bfloat16 only",
    "deepseek_v3": "its MLA CPU kernels take bfloat16 (AMX) or the 576 latent size only",
}


def _vllm(name: str) -> str:
    """The vLLM column: what vLLM's CPU build does with the family (`families.VLLM_CPU_FAMILIES`,
    which engine='vllm' checks before the model loads) and the test that shows it."""
    from nbtrain.model.families import VLLM_CPU_FAMILIES, VLLM_CPU_LORA_REFUSED

    if name not in VLLM_CPU_FAMILIES:
        return "not yet run"
    refused = VLLM_CPU_FAMILIES[name]
    if refused is not None:
        return f"refused on a CPU: {_VLLM_WHY.get(name, 'see nbtrain/model/families.py')}"
    where = _VLLM_TEST if name in VLLM_TESTED else f"{_VLLM_TEST} with NBTRAIN_VLLM_ALL_FAMILIES=1"
    if name in VLLM_CPU_LORA_REFUSED:
        return f"base tested ({where}); with a LoRA refused on a CPU"
    return f"tested, base and LoRA ({where})"


def _packing(name: str) -> str:
    """What nbtrain does with packing on this family: the refusal's reason, from the same function
    `finetune` asks (`nbtrain.model.report.packing_refusal`), on the family's tiny config."""
    from transformers.utils import logging as hf_logging

    from nbtrain.model.report import MASK_IGNORES_POSITIONS, packing_refusal

    was = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # a tiny config's notes (YaRN factors) are not the reader's
    try:
        config = FAMILIES[name].build_config(
            vocab_size=512,
            hidden_size=64,
            num_layers=2,
            heads=4,
            intermediate_size=128,
            max_positions=512,
            special={"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
        )
    finally:
        hf_logging.set_verbosity(was)
    if packing_refusal(config) is None:
        return "exact"
    if config.model_type in MASK_IGNORES_POSITIONS:
        return "refused (its mask ignores position_ids)"
    return "refused (recurrent state)"


def table() -> str:
    columns = [*TESTED, *ELSEWHERE, "vLLM"]
    lines = [
        "| family | kind | config class | " + " | ".join(columns) + " |",
        "|---|---|---|" + "---|" * len(columns),
    ]
    for name, fam in FAMILIES.items():
        cells = [name, fam.kind, f"`{fam.config}`"]
        for col in TESTED:
            cells.append(_packing(name) if col == "packing" else "tested")
        for where in ELSEWHERE.values():
            cells.append(where.get(name, "not yet run"))
        cells.append(_vllm(name))
        lines.append("| " + " | ".join(cell(c) for c in cells) + " |")
    return "\n".join(lines)


TABLE = GeneratedTable("model matrix table", COMMAND, PAGE, table)

if __name__ == "__main__":
    sys.exit(TABLE.main(description=__doc__))
