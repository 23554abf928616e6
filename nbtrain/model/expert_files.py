"""Fused experts from a checkpoint that stores each expert apart, for FSDP2's own loader
(`nbtrain.model.shard`): Qwen3-MoE, DeepSeek-V3 and Qwen3-Next keep `mlp.experts.0.gate_proj.weight`,
`mlp.experts.0.up_proj.weight`... one file entry per expert, and transformers fuses them into the
model's `mlp.experts.gate_up_proj` / `down_proj` as it loads. This follows transformers' own
conversion mapping for the model type (its expert-merging WeightConverters), reading only the experts
whose rows a rank holds."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class Stacked:
    """A fused expert weight as transformers' WeightConverter builds it: MergeModulelist(dim=0)
    (torch.stack over the experts, in order), then Concatenate(dim=1) over the source patterns in
    their order (gate before up). `[a:b]` reads experts a..b-1 alone, so no rank reads every expert."""

    def __init__(self, files: dict[str, Any], keys: list[list[str]], concat: bool) -> None:
        self.files, self.keys, self.concat = files, keys, concat  # keys[pattern][expert]

    def __getitem__(self, rows: slice) -> Any:
        import torch

        parts = [
            torch.stack([self.files[k].get_tensor(k) for k in per_expert[rows]])
            for per_expert in self.keys
        ]
        return torch.cat(parts, dim=1) if self.concat else parts[0]


def converters(model_type: str) -> list[tuple[list[str], str, bool]]:
    """(source patterns, target, concatenated) of transformers' expert-merging converters for
    `model_type`: the WeightConverters whose operations are MergeModulelist(dim=0), optionally
    followed by Concatenate(dim=1); none for a model whose checkpoints hold the experts fused."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

    out = []
    for c in get_checkpoint_conversion_mapping(model_type) or []:
        if not isinstance(c, WeightConverter) or len(c.target_patterns) != 1:
            continue
        ops = [(type(o), getattr(o, "dim", None)) for o in c.operations]
        if ops in ([(MergeModulelist, 0)], [(MergeModulelist, 0), (Concatenate, 1)]):
            out.append((list(c._original_source_patterns), c.target_patterns[0], len(ops) == 2))
    return out


def fused(
    model_type: str, paths: list[Path], params: dict[str, Any], prefix: str
) -> Iterator[tuple[str, Stacked]]:
    """(name, its fused weight to slice) for each of `params` (the model's names, without peft's
    base_layer) that the files hold one entry per expert of; the files stay open while the caller
    reads. `prefix`: the model's own (`model.`), which a checkpoint's keys may lack."""
    from safetensors import safe_open

    found = converters(model_type)
    if not found:
        return
    with contextlib.ExitStack() as stack:
        files: dict[str, Any] = {}
        for path in paths:
            f = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            for key in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                files[key] = f
        for name in params:
            for sources, target, concat in found:
                if not name.endswith("." + target):
                    continue
                stem, experts = name[: -len(target)], params[name].shape[0]
                keys = []
                for pattern in sources:
                    per = [stem + pattern.replace("*", str(e)) for e in range(experts)]
                    if not all(k in files for k in per):
                        per = [k.removeprefix(prefix) for k in per]
                    keys.append(per)
                if all(k in files for per in keys for k in per):
                    log.debug("%s: fused from %d file entries", name, sum(map(len, keys)))
                    yield name, Stacked(files, keys, concat)
                break
