"""`SFTConfig`: every setting of a fine-tuning run, checked where it enters (before any engine work).

Field names follow transformers' `TrainingArguments` and TRL's `SFTConfig`, so users know them.

In [1]: cfg = nbtrain.SFTConfig(model="tiny-llama", data="train.jsonl", output_dir="runs/first",
   ...:                         max_steps=200, per_device_train_batch_size=4, learning_rate=2e-4)
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from nbtrain.configs.field_types import type_problems
from nbtrain.configs.lora import lora_problems
from nbtrain.data.prompts import sampling_problems
from nbtrain.errors import ConfigError
from nbtrain.telemetry import tracking

log = logging.getLogger(__name__)

SCHEDULERS: tuple[str, ...] = ("linear", "cosine", "cosine_with_restarts", "polynomial")
SCHEDULERS += ("constant", "constant_with_warmup", "inverse_sqrt")
DTYPES = ("auto", "float32", "bfloat16")
# the generation engines (nbtrain.generation.engines): transformers' generate, the reference, and vLLM
ENGINES = ("hf", "vllm")
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16"}
DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
# "org/name" or "name": what the Hub accepts as a repo id
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass
class SFTConfig:
    """Settings of one LoRA supervised fine-tuning run; `nbtrain.finetune(cfg)` runs it on every rank."""

    model: str = field(
        default="", metadata={"help": "Hub id or local folder of a causal LM (from_pretrained)."}
    )
    data: Any = field(
        default=None,
        metadata={
            "help": "Training rows: a .jsonl/.json/.parquet/.csv path, a list of dicts, a DataFrame or a datasets.Dataset."
        },
    )
    eval_data: Any = field(
        default=None, metadata={"help": "Optional evaluation rows, in any form `data` accepts."}
    )
    chat_template_kwargs: dict | None = field(
        default=None,
        metadata={
            "help": "Arguments for the chat template of every row, e.g. {'enable_thinking': False} (Qwen3); a row's own chat_template_kwargs win."
        },
    )
    data_cache: str = field(
        default="auto",
        metadata={
            "help": "Folder of the tokenized-data cache; 'auto': $NBTRAIN_DATA_CACHE, else $NBTRAIN_HOME/data-cache, else ~/.cache/nbtrain/data; 'off': tokenize every run, keep nothing."
        },
    )
    output_dir: str = field(
        default="nbtrain-output",
        metadata={"help": "Folder for checkpoints, metrics.jsonl and the exported adapter."},
    )
    max_steps: int = field(
        default=-1, metadata={"help": "Optimizer steps to run; -1 means num_train_epochs decides."}
    )
    num_train_epochs: float = field(
        default=1.0, metadata={"help": "Passes over the data when max_steps is -1."}
    )
    per_device_train_batch_size: int | str = field(
        default=4,
        metadata={
            "help": "Rows per rank per micro-batch, or 'auto': the largest that fits in memory, found once at start."
        },
    )
    global_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Rows per optimizer step across all ranks; with 'auto' micro-batches, gradient accumulation makes up the rest. None: ranks x batch x accumulation steps."
        },
    )
    gradient_accumulation_steps: int = field(
        default=1, metadata={"help": "Micro-batches per optimizer step."}
    )
    learning_rate: float = field(default=2e-4, metadata={"help": "Peak AdamW learning rate."})
    lr_scheduler_type: str = field(
        default="linear",
        metadata={"help": f"Learning-rate schedule: one of {', '.join(SCHEDULERS)}."},
    )
    warmup_steps: int = field(
        default=0, metadata={"help": "Steps of linear warm-up from 0 to learning_rate."}
    )
    max_length: int = field(
        default=1024,
        metadata={"help": "Tokens per sequence; longer rows are cut (counted) unless packing."},
    )
    truncation_side: str = field(
        default="right",
        metadata={
            "help": "Which end of a row longer than max_length is cut: 'right' or 'left' (keeps the last turns)."
        },
    )
    packing: bool = field(
        default=False,
        metadata={
            "help": "Concatenate rows into max_length blocks; each row attends only to itself."
        },
    )
    padding_free: bool = field(
        default=False,
        metadata={
            "help": "Put a micro-batch's rows side by side in one row, no pad tokens (best with flash attention)."
        },
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(
        default=32, metadata={"help": "LoRA scaling numerator (scale = lora_alpha / lora_r)."}
    )
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA input."})
    target_modules: str | list[str] = field(
        default="all-linear", metadata={"help": "Module names to adapt, or 'all-linear'."}
    )
    lora_moe: str | list[str] = field(
        default_factory=lambda: ["experts", "shared_experts"],
        metadata={
            "help": "MoE: what 'all-linear' adapts beyond attention, of experts, shared_experts, router."
        },
    )
    router_aux_loss_coef: float | None = field(
        default=None,
        metadata={
            "help": "MoE: weight of the router's load-balancing loss in SFT; None: as the model's config says (output_router_logits), 0: off."
        },
    )
    logging_steps: int = field(
        default=10, metadata={"help": "Log metrics every this many steps (and at the last step)."}
    )
    report_to: str | list[str] = field(
        default="none",
        metadata={
            "help": "Also send the logged rows to 'tensorboard', 'mlflow', a list of them, 'all' (those installed) or 'none'; rank 0 writes."
        },
    )
    logging_dir: str | None = field(
        default=None,
        metadata={
            "help": "TensorBoard folder (report_to='tensorboard'); None: $TENSORBOARD_LOGGING_DIR, else output_dir/runs."
        },
    )
    eval_steps: int | None = field(
        default=None,
        metadata={
            "help": "Evaluate every this many steps (needs eval_data); None: at the end only."
        },
    )
    save_steps: int | None = field(
        default=500,
        metadata={"help": "Checkpoint every this many steps and at the last step; None: never."},
    )
    save_total_limit: int | None = field(
        default=None,
        metadata={
            "help": "Keep at most this many checkpoints, deleting the oldest after each save; None: keep all."
        },
    )
    resume: str | None = field(
        default=None,
        metadata={
            "help": "None, 'latest' (newest checkpoint in output_dir) or a checkpoint folder."
        },
    )
    seed: int = field(default=42, metadata={"help": "Seed for LoRA init, data order and dropout."})
    dtype: str = field(
        default="auto",
        metadata={
            "help": "'auto' (bf16 autocast on GPUs that support it, else fp32), 'float32' or 'bfloat16'."
        },
    )
    use_liger_kernel: bool | str = field(
        default="auto",
        metadata={
            "help": "Liger's RMSNorm/SwiGLU/RoPE kernels on GPU: 'auto' (where liger-kernel is installed and torch_compile is off), True or False."
        },
    )
    torch_compile: bool = field(
        default=False,
        metadata={
            "help": "torch.compile each transformer block (GPU: faster after a one-off compile of some seconds)."
        },
    )
    fused_cross_entropy: bool = field(
        default=True,
        metadata={
            "help": "Loss from the last hidden states in chunks, never the whole logits (Liger's kernel on GPU where installed)."
        },
    )
    gradient_checkpointing: bool = field(
        default=False, metadata={"help": "Recompute activations in backward to save memory."}
    )
    overwrite: bool = field(
        default=False,
        metadata={
            "help": "Start over in an output_dir that holds another run (its checkpoints, adapter, metrics)."
        },
    )
    max_grad_norm: float = field(
        default=1.0,
        metadata={"help": "Clip the global gradient norm to this; 0 disables clipping."},
    )
    run_name: str | None = field(
        default=None, metadata={"help": "Name shown in the live display and the runs sidebar."}
    )
    # ---- samples while training (nbtrain.generation.sampling)
    sample_prompts: Any = field(
        default=None,
        metadata={
            "help": "Prompts to complete while training (strings, message lists, or a .jsonl/.json/.parquet/.csv of rows as data takes; a row's completion is the reference); written to output_dir/samples.jsonl and shown live."
        },
    )
    sample_steps: int | None = field(
        default=None,
        metadata={
            "help": "Sample every this many steps (and at step 0 and the last step); None: at step 0 and the last step only."
        },
    )
    sample_max_new_tokens: int = field(
        default=64, metadata={"help": "Tokens to generate per sample prompt (greedy)."}
    )
    sample_engine: str = field(
        default="hf",
        metadata={
            "help": "What generates the samples: 'hf' (transformers, the reference) or 'vllm' (a vLLM engine beside each rank, the adapter in memory; pip install nbtrain[vllm])."
        },
    )
    # ---- models bigger than one GPU (nbtrain.model.shard, nbtrain.model.quant)
    shard: str = field(
        default="ddp",
        metadata={
            "help": "'ddp': every rank holds the whole model; 'fsdp': weights and LoRA sharded over all ranks (FSDP2); 'hsdp': sharded within a node, replicated across nodes."
        },
    )
    load_in_4bit: bool = field(
        default=False,
        metadata={
            "help": "QLoRA: base weights in 4-bit NF4 (bitsandbytes), LoRA trained in bf16/fp32."
        },
    )
    load_in_8bit: bool = field(
        default=False,
        metadata={"help": 'Base weights in 8-bit (bitsandbytes LLM.int8; `shard="ddp"` only).'},
    )

    def __post_init__(self) -> None:
        problems: list[str] = []

        def need(ok: bool, msg: str) -> None:
            if not ok:
                problems.append(msg)

        def positive_int(name: str, allow_none: bool = False) -> None:
            value = getattr(self, name)
            if value is None and allow_none:
                return
            need(
                isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                f"{name}={value!r} must be an integer >= 1",
            )

        need(
            isinstance(self.model, str | os.PathLike) and bool(str(self.model)),
            "model is required: pass a Hub id such as 'Qwen/Qwen2.5-0.5B' or a local folder holding "
            "a causal LM saved with save_pretrained",
        )
        if isinstance(self.model, os.PathLike):
            self.model = os.fspath(self.model)
        if isinstance(self.model, str) and self.model:
            local = Path(self.model).expanduser()
            looks_local = self.model.startswith((".", "/", "~")) or not _HUB_ID.match(self.model)
            if not local.exists() and looks_local:
                problems.append(
                    f"model folder {self.model!r} does not exist; pass an existing folder written by "
                    "save_pretrained, or a Hub id such as 'Qwen/Qwen2.5-0.5B'"
                )
            elif local.exists() and not local.is_dir():
                problems.append(
                    f"model {self.model!r} is a file; pass the folder that holds config.json and the weights"
                )
        need(
            self.data is not None,
            "data is required: a .jsonl/.json/.parquet/.csv path, a list of dicts, a DataFrame or a datasets.Dataset",
        )
        for name in ("data", "eval_data"):
            value = getattr(self, name)
            if isinstance(value, str | os.PathLike):
                path = Path(value).expanduser()
                if not path.exists():
                    problems.append(
                        f"{name} file {os.fspath(value)!r} not found; check the path (relative paths are from {os.getcwd()})"
                    )
                elif path.suffix.lower() not in DATA_SUFFIXES:
                    problems.append(
                        f"{name} file {os.fspath(value)!r} has an unknown suffix; use one of {', '.join(DATA_SUFFIXES)}"
                    )
                setattr(self, name, os.fspath(value))
        need(
            isinstance(self.output_dir, str | os.PathLike) and bool(str(self.output_dir)),
            "output_dir is required: a folder for checkpoints and the adapter",
        )
        self.output_dir = os.fspath(self.output_dir)

        need(
            isinstance(self.max_steps, int) and (self.max_steps == -1 or self.max_steps >= 1),
            f"max_steps={self.max_steps!r} must be >= 1 (or -1 to train for num_train_epochs)",
        )
        if self.max_steps == -1:
            need(
                isinstance(self.num_train_epochs, int | float) and self.num_train_epochs > 0,
                f"num_train_epochs={self.num_train_epochs!r} must be > 0 when max_steps is -1",
            )
        if self.per_device_train_batch_size != "auto":
            positive_int("per_device_train_batch_size")
        positive_int("global_batch_size", allow_none=True)
        need(
            self.use_liger_kernel in (True, False, "auto"),
            f"use_liger_kernel={self.use_liger_kernel!r} must be True, False or 'auto'",
        )
        for name in ("torch_compile", "fused_cross_entropy"):
            need(
                isinstance(getattr(self, name), bool),
                f"{name}={getattr(self, name)!r} must be True or False",
            )
        for name in (
            "gradient_accumulation_steps",
            "max_length",
            "lora_r",
            "logging_steps",
        ):
            positive_int(name)
        positive_int("eval_steps", allow_none=True)
        # without eval_data there is nothing to evaluate, and the setting would be ignored silently
        need(
            self.eval_steps is None or self.eval_data is not None,
            f"eval_steps={self.eval_steps!r} needs eval_data, which is None; pass eval_data (rows to "
            "evaluate on, in any form data accepts) or drop eval_steps",
        )
        need(
            self.chat_template_kwargs is None or isinstance(self.chat_template_kwargs, dict),
            f"chat_template_kwargs={self.chat_template_kwargs!r} must be a dict such as "
            "{'enable_thinking': False}, or None",
        )
        need(
            isinstance(self.data_cache, str) and bool(self.data_cache),
            f"data_cache={self.data_cache!r} must be 'auto', 'off' or a folder path (a string)",
        )
        positive_int("save_steps", allow_none=True)
        positive_int("save_total_limit", allow_none=True)
        need(
            isinstance(self.seed, int) and not isinstance(self.seed, bool),
            f"seed={self.seed!r} must be an integer, e.g. 42",
        )
        # report_to becomes a list, as in transformers; a reporter whose package is missing fails here
        self.report_to, report_problems = tracking.normalize_report_to(self.report_to)
        problems += report_problems
        if isinstance(self.logging_dir, os.PathLike):
            self.logging_dir = os.fspath(self.logging_dir)
        need(
            self.logging_dir is None
            or (isinstance(self.logging_dir, str) and bool(self.logging_dir)),
            f"logging_dir={self.logging_dir!r} must be None or a folder path",
        )
        need(
            isinstance(self.warmup_steps, int) and self.warmup_steps >= 0,
            f"warmup_steps={self.warmup_steps!r} must be an integer >= 0",
        )
        need(
            isinstance(self.learning_rate, int | float) and self.learning_rate > 0,
            f"learning_rate={self.learning_rate!r} must be > 0, e.g. 2e-4 for LoRA",
        )
        need(
            isinstance(self.max_grad_norm, int | float) and self.max_grad_norm >= 0,
            f"max_grad_norm={self.max_grad_norm!r} must be >= 0 (0 disables clipping)",
        )
        need(
            self.lr_scheduler_type in SCHEDULERS,
            f"lr_scheduler_type={self.lr_scheduler_type!r} is not supported; use one of {', '.join(SCHEDULERS)}",
        )
        dtype = _DTYPE_ALIASES.get(str(self.dtype), self.dtype)
        if dtype in ("float16", "fp16"):
            problems.append(
                "dtype='float16' is not supported: fp16 training needs loss scaling. Use 'bfloat16' or 'float32' instead"
            )
        elif dtype not in DTYPES:
            problems.append(
                f"dtype={self.dtype!r} is not supported; use one of {', '.join(DTYPES)}"
            )
        else:
            self.dtype = dtype
        need(
            self.truncation_side in ("right", "left"),
            f"truncation_side={self.truncation_side!r} must be 'right' or 'left'",
        )
        problems += lora_problems(self)
        if self.resume is not None:
            if isinstance(self.resume, os.PathLike):
                self.resume = os.fspath(self.resume)
            if not isinstance(self.resume, str):
                problems.append(
                    f"resume={self.resume!r} must be None, 'latest' or a checkpoint folder"
                )
            elif self.resume != "latest" and not Path(self.resume).expanduser().is_dir():
                problems.append(
                    f"resume checkpoint {self.resume!r} not found; pass resume='latest' or an existing checkpoint-<step> folder"
                )
            elif self.overwrite:
                problems.append("resume and overwrite=True contradict each other; drop one of them")

        problems.extend(sampling_problems(self))
        if self.sample_engine not in ENGINES:
            problems.append(
                f"sample_engine={self.sample_engine!r} is not an engine; use one of {', '.join(map(repr, ENGINES))}"
            )
        elif self.sample_engine == "vllm" and (self.shard != "ddp" or self.load_in_4bit):
            problems.append(
                "sample_engine='vllm' loads the base in full precision, whole, beside each rank; use it with shard='ddp' and without load_in_4bit, or sample with 'hf'"
            )
        problems.extend(_sharding_problems(self))
        problems.extend(self._own_problems())
        wrong = type_problems(self)  # said as the type, not again as a bad value
        problems = [*wrong.values(), *(p for p in problems if p.split("=")[0] not in wrong)]
        if problems:
            lines = "\n".join(f"  - {p}" for p in problems)
            msg = f"invalid {type(self).__name__}:\n{lines}"
            raise ConfigError(msg)

    def _own_problems(self) -> list[str]:
        """What a config built on this one (DPOConfig) finds wrong with its own fields; reported with
        the rest, in one ConfigError."""
        return []

    def to_dict(self) -> dict[str, Any]:
        """The settings as JSON-ready values (in-memory data shown by its type and length)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            in_memory = f.name in ("data", "eval_data") or (
                # a list of prompts is kept as it is; a DataFrame or Dataset of them is summarised
                f.name == "sample_prompts" and not isinstance(value, list)
            )
            if in_memory and value is not None and not isinstance(value, str):
                try:
                    value = f"<{type(value).__name__} of {len(value)} rows>"
                except TypeError:
                    value = f"<{type(value).__name__}>"
            out[f.name] = value
        return out

    @classmethod
    def help(cls) -> str:
        """One line per field: name, default and what it does."""
        return "\n".join(f"{f.name} = {f.default!r}: {f.metadata['help']}" for f in fields(cls))


def known_keywords_only(init: Any) -> Any:
    """A config's generated __init__, refusing an unknown keyword with the nearest field's name
    (`learning_rte=` -> learning_rate) instead of Python's bare TypeError."""
    import difflib
    import functools

    @functools.wraps(init)
    def checked(self: SFTConfig, *args: Any, **kwargs: Any) -> None:
        names = [f.name for f in fields(type(self))]
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            lines = []
            for k in unknown:
                near = difflib.get_close_matches(k, names, n=1, cutoff=0.6)
                hint = f" (did you mean {near[0]}?)" if near else ""
                lines.append(f"unknown setting {k}{hint}")
            cls = type(self).__name__
            msg = f"{cls}: " + "; ".join(lines) + f". {cls}.help() lists every setting."
            raise ConfigError(msg)
        init(self, *args, **kwargs)

    return checked


SFTConfig.__init__ = known_keywords_only(SFTConfig.__init__)  # type: ignore[method-assign]


SHARDS = ("ddp", "fsdp", "hsdp")


def _sharding_problems(cfg: SFTConfig) -> list[str]:
    """What is wrong with shard / load_in_4bit / load_in_8bit on their own (the device-dependent checks
    run on every rank at set-up: nbtrain.model.shard.check_shard, nbtrain.model.quant.check_quant)."""
    problems = []
    if cfg.shard not in SHARDS:
        problems.append(f"shard={cfg.shard!r} is not known; use one of {', '.join(SHARDS)}")
    for name in ("load_in_4bit", "load_in_8bit"):
        if not isinstance(getattr(cfg, name), bool):
            problems.append(f"{name}={getattr(cfg, name)!r} must be True or False")
    if cfg.load_in_4bit is True and cfg.load_in_8bit is True:
        problems.append(
            "load_in_4bit and load_in_8bit are both True; pick one (4-bit NF4 is the QLoRA recipe)"
        )
    return problems


__all__ = ["SFTConfig"]
