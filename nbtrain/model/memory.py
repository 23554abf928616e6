"""Memory per rank of a LoRA run, by formula: what the docs' "Which to choose" table shows and what the
set-up checks before loading a model that cannot fit (`check_fits`).

In [1]: from nbtrain.model.memory import LLAMA3_8B, rank_memory
In [2]: rank_memory(LLAMA3_8B, shard="fsdp", world=8)["total"] / 2**30

Assumptions (bytes per value): base weights in bf16 (2), or NF4 with double quantisation (0.5 + 1/64 for
the block scales; embeddings and lm_head in fp32, as peft's k-bit preparation upcasts them), or int8
(1 + 1/64); LoRA weights, their gradients
and both AdamW moments in fp32 (4 + 4 + 8); activations in bf16 with SDPA/flash attention (no
sequence^2 term), about 8*hidden + 3*intermediate values per token per layer kept for backward, or, with
gradient checkpointing, each block's input (hidden values per token per layer) plus one block's
activations. Sharding divides weights, LoRA, gradients and optimizer state by the shard size (all ranks
for fsdp, the ranks of a node for hsdp); FSDP2 also holds the block being computed and the next one
(prefetch) unsharded, and the root unit (embeddings, final norm, lm_head) unsharded from forward to
backward. Under QLoRA FSDP2 shards the 4-bit words but not their block scales, which every rank keeps
whole (1/64 byte per value). Loading needs less than training: a sharded run reads and quantises one
weight at a time (`nbtrain.model.shard`). Not counted: the CUDA context and allocator slack (about 1-2
GiB on a GPU).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from nbtrain.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shape:
    """What the formula needs of a decoder-only transformer (Llama / Qwen / Mistral layout)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool = False
    #: an MoE's parameters per block (experts, router, shared experts, attention), counted on the meta
    #: device (`for_config`); None: the dense formula
    measured_block: int | None = None
    #: the MLP width one token computes through on an MoE (its top-k experts and the shared ones), for
    #: the activations; None: `intermediate`
    active_intermediate: int | None = None
    #: 'all-linear' LoRA parameters at rank 1 (experts included), counted; None: the dense formula
    lora_per_rank: int | None = None

    #: the width of one attention head where it is not hidden / heads (Qwen3, Gemma); None: that
    head_dim: int | None = None

    @property
    def kv_dim(self) -> int:
        return (self.head_dim or self.hidden // self.heads) * self.kv_heads

    @property
    def q_dim(self) -> int:
        return (self.head_dim or self.hidden // self.heads) * self.heads

    @property
    def attention_params(self) -> int:
        h = self.hidden
        return h * (2 * self.q_dim + 2 * self.kv_dim) + 2 * h

    @property
    def block_params(self) -> int:
        if self.measured_block is not None:
            return self.measured_block
        return self.attention_params + 3 * self.hidden * self.intermediate

    @property
    def edge_params(self) -> int:
        """Embeddings, lm_head and the final norm: the root FSDP unit."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.block_params + self.edge_params

    @classmethod
    def from_config(cls, config: Any) -> Shape | None:
        """From a transformers config of the Llama layout; None where the config lacks the fields."""
        try:
            return cls(
                layers=int(config.num_hidden_layers),
                hidden=int(config.hidden_size),
                intermediate=int(config.intermediate_size),
                heads=int(config.num_attention_heads),
                kv_heads=int(
                    getattr(config, "num_key_value_heads", None) or config.num_attention_heads
                ),
                vocab=int(config.vocab_size),
                tied=bool(getattr(config, "tie_word_embeddings", False)),
                head_dim=_head_dim(config),
            )
        except (AttributeError, TypeError, ValueError):
            return None

    @classmethod
    def for_config(cls, config: Any) -> Shape | None:
        """`from_config`, and on an MoE config the blocks, the active MLP width and the LoRA counted on
        a meta-device build of the model (no memory): the dense formula would count one MLP where
        the model holds E experts."""
        text = getattr(config, "get_text_config", lambda: config)()
        shape = cls.from_config(text)
        if shape is None or not is_moe(text):
            return shape
        return _measured(shape, config)


def _head_dim(config: Any) -> int | None:
    """config.head_dim where it differs from hidden / heads; None otherwise."""
    hd = getattr(config, "head_dim", None)
    if not isinstance(hd, int) or hd == int(config.hidden_size) // int(config.num_attention_heads):
        return None
    return hd


def is_moe(config: Any) -> bool:
    """Whether a transformers config declares routed experts."""
    names = ("num_experts", "num_local_experts", "n_routed_experts")
    return any((getattr(config, n, 0) or 0) > 0 for n in names)


def _measured(shape: Shape, config: Any) -> Shape:
    import dataclasses

    import torch
    from transformers import AutoModelForCausalLM

    from nbtrain.model import targets

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    active = targets.active_numel(model, total)
    edge = shape.edge_params
    block = (total - edge) // shape.layers
    active_mlp = (active - edge) // shape.layers - shape.attention_params
    plan = targets.plan(model)
    lora = targets.lora_numel(model, plan.linear, plan.expert_params, 1)
    return dataclasses.replace(
        shape,
        measured_block=block,
        active_intermediate=max(1, active_mlp // (3 * shape.hidden)),
        lora_per_rank=lora,
    )


# Meta's published configs (config.json of meta-llama/Meta-Llama-3-8B and -70B)
LLAMA3_8B = Shape(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256)
LLAMA3_70B = Shape(layers=80, hidden=8192, intermediate=28672, heads=64, kv_heads=8, vocab=128256)


def lora_params(shape: Shape, r: int) -> int:
    """LoRA weights with target_modules='all-linear' (q, k, v, o, gate, up, down; not lm_head; on an
    MoE, as counted by `Shape.for_config`, the experts too)."""
    if shape.lora_per_rank is not None:
        return shape.lora_per_rank * r
    h, q, kv, i = shape.hidden, shape.q_dim, shape.kv_dim, shape.intermediate
    per_layer = r * ((h + q) * 2 + (h + kv) * 2 + (h + i) * 3)
    return shape.layers * per_layer


SCALES = (
    1 / 64
)  # bytes per value of a quantised weight's block scales (one 8-bit scale per 64 values)
PER_VALUE = {None: 2.0, "nf4": 0.5 + SCALES, "int8": 1.0 + SCALES}


def weight_bytes(shape: Shape, quant: str | None) -> float:
    """The base weights in memory: bf16, or 'nf4' / 'int8' for the linear layers of the blocks (then
    the embeddings and lm_head are fp32: peft's prepare_model_for_kbit_training upcasts them)."""
    edge = 2.0 if quant is None else 4.0
    return shape.layers * shape.block_params * PER_VALUE[quant] + shape.edge_params * edge


def rank_memory(
    shape: Shape,
    *,
    shard: str = "ddp",
    world: int = 1,
    ranks_per_node: int | None = None,
    quant: str | None = None,
    lora_r: int = 16,
    seq_len: int = 2048,
    micro_batch: int = 1,
    gradient_checkpointing: bool = True,
) -> dict[str, float]:
    """Bytes per rank, by part, and their "total" (see the module's assumptions)."""
    n = {"ddp": 1, "fsdp": world, "hsdp": ranks_per_node or world}[shard]
    lora = lora_params(shape, lora_r)
    weights = weight_bytes(shape, quant) / n
    if quant == "nf4" and n > 1:
        # each 4-bit layer's block scales (its quant_state) stay whole on every rank: FSDP2 shards the
        # packed words only
        weights += shape.layers * shape.block_params * SCALES * (1 - 1 / n)
    parts = {
        "weights": weights,
        "lora": lora * 4.0 / n,
        "grads": lora * 4.0 / n,
        "optimizer": lora * 8.0 / n,
        "gathered": 0.0,
    }
    if n > 1:
        # the current block and the prefetched next one (4-bit words stay 4-bit), and the root unit,
        # unsharded in bf16
        parts["gathered"] = 2 * shape.block_params * PER_VALUE[quant] + shape.edge_params * 2.0
    h, i = shape.hidden, shape.active_intermediate or shape.intermediate
    tokens = seq_len * micro_batch
    full_block = (8 * h + 3 * i) * 2.0 * tokens
    if gradient_checkpointing:
        parts["activations"] = shape.layers * h * 2.0 * tokens + full_block
    else:
        parts["activations"] = shape.layers * full_block
    parts["total"] = sum(parts.values())
    return parts


def check_fits(cfg: Any, config: Any, device: Any, world: int) -> str | None:
    """On a GPU, a ConfigError before loading when the model's fixed memory per rank (everything but
    activations) cannot fit the card; the formula's estimate as a note otherwise. None on the CPU."""
    import os

    import torch

    if device.type != "cuda":
        return None
    shape = Shape.for_config(config)
    if shape is None:
        return None
    quant = "nf4" if cfg.load_in_4bit else "int8" if cfg.load_in_8bit else None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    est = rank_memory(
        shape,
        shard=cfg.shard,
        world=world,
        ranks_per_node=local,
        quant=quant,
        lora_r=cfg.lora_r,
        seq_len=cfg.max_length,
        gradient_checkpointing=cfg.gradient_checkpointing,
    )
    fixed = est["total"] - est["activations"]
    total = torch.cuda.get_device_properties(device).total_memory
    gib = 2**30
    if fixed > 0.95 * total:
        msg = (
            f"the model needs about {fixed / gib:.1f} GiB per rank before any activations with "
            f"shard={cfg.shard!r} on {world} rank(s) (weights {est['weights'] / gib:.1f} GiB), more than "
            f"the GPU's {total / gib:.1f} GiB; use shard='fsdp' over more ranks, or load_in_4bit=True "
            "with shard='ddp' (see 'Which to choose' in docs/fine-tuning.md)"
        )
        raise ConfigError(msg)
    return (
        f"memory per rank by formula: weights {est['weights'] / gib:.2f} GiB, LoRA+grads+AdamW "
        f"{(est['lora'] + est['grads'] + est['optimizer']) / gib:.2f} GiB, one row of activations "
        f"{est['activations'] / gib:.2f} GiB"
    )


# ------------------------------------------------------------------------------------- the docs table
BEGIN = "<!-- BEGIN memory table: generated by `python -m nbtrain.model.memory`; do not edit -->"
END = "<!-- END memory table -->"
# (label, shape, shard, world, ranks per node, quant): the set-ups the docs compare, 8 GPUs a node
SETUPS = [
    ("8B", "ddp", 8, None),
    ("8B", "fsdp", 8, None),
    ("8B", "ddp", 8, "nf4"),
    ("70B", "ddp", 8, None),
    ("70B", "fsdp", 8, None),
    ("70B", "hsdp", 16, None),
    ("70B", "fsdp", 16, None),
    ("70B", "ddp", 8, "nf4"),
    ("70B", "fsdp", 8, "nf4"),
]
SHAPES = {"8B": LLAMA3_8B, "70B": LLAMA3_70B}


def table(seq_len: int = 2048, lora_r: int = 16) -> str:
    """The markdown table of `rank_memory` for Llama-3 8B and 70B (GiB per GPU, 8 GPUs per node)."""
    gib = 2**30
    rows = [
        "| model | set-up | GPUs | weights | LoRA + grads + AdamW | gathered (FSDP) | activations | total |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, shard, world, quant in SETUPS:
        m = rank_memory(
            SHAPES[label],
            shard=shard,
            world=world,
            ranks_per_node=8,
            quant=quant,
            lora_r=lora_r,
            seq_len=seq_len,
        )
        name = f"shard={shard!r}" + (", load_in_4bit" if quant else "")
        train = m["lora"] + m["grads"] + m["optimizer"]
        rows.append(
            f"| Llama-3 {label} | `{name}` | {world} | {m['weights'] / gib:.1f} | {train / gib:.2f} | "
            f"{m['gathered'] / gib:.1f} | {m['activations'] / gib:.1f} | **{m['total'] / gib:.1f}** |"
        )
    return "\n".join(rows)


def render(page_text: str) -> str:
    """The page with the text between the table's markers replaced by a fresh table."""
    start, end = page_text.find(BEGIN), page_text.find(END)
    if start < 0 or end < start:
        msg = f"the page has no memory table markers; put these two lines where it goes:\n{BEGIN}\n{END}"
        raise ValueError(msg)
    return page_text[: start + len(BEGIN)] + "\n" + table() + "\n" + page_text[end:]


if __name__ == "__main__":
    from pathlib import Path

    page = Path(__file__).resolve().parents[2] / "docs" / "fine-tuning.md"
    page.write_text(render(page.read_text(encoding="utf-8")), encoding="utf-8")
    print(f"wrote the memory table into {page}")
