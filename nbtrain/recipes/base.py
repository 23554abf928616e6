"""What a recipe is: the methods `finetune` and `nbtrain.Run` call, and the settings every recipe reads
from its config, once. It has no step, no loop and no set-up: each recipe writes those in its own file.

In [1]: recipe = SFTRecipe(cfg)      # reads cfg, once (here)
In [2]: recipe.setup()               # the recipe's set-up, over `nbtrain.recipes.run_setup`'s phases
In [3]: recipe.train()               # `nbtrain.recipes.loop.train(recipe, recipe.train_step)`
In [4]: recipe.result()              # the TrainResult `finetune` returns (`nbtrain.recipes.saves`)

A recipe's own file holds its `setup()`, `train_step()`, `train()` (the loop call), `log(row)` (its
figures added to a row), `eval_metrics()`, `save_checkpoint(step)`, `export()`, `cleanup()` and
`result()`; the shared parts are components it calls (`run_setup`, `loop`, `saves`), not ancestors.
Every hook gets the recipe (`nbtrain.recipes.hooks`), and reads these attributes off it: `cfg`, `d`,
`step`, `total_steps`, `peft_model`, `model`, `optimizer`, `tokenizer`, `meter`, `runlog`, `out`.
"""

from __future__ import annotations

import contextlib
import logging
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from nbtrain.configs.sft import SFTConfig
from nbtrain.engine.signals import interrupts
from nbtrain.errors import ConfigError
from nbtrain.generation.sampling import Sampler
from nbtrain.recipes import step as one_step
from nbtrain.recipes.hooks import Hooks
from nbtrain.recipes.saves import TrainResult
from nbtrain.telemetry.report import RunLog

log = logging.getLogger(__name__)


class Recipe(ABC):
    """One run on this rank: `setup()`, `train()`, `result()` (or `run()`), the contract every recipe
    keeps; the settings it reads from `cfg` here, once.

    `group` trains on a sub-group of the running process group (its ranks are the run's ranks 0..n-1);
    `hooks` are called at the loop's named places (`nbtrain.recipes.hooks.Hooks`).
    """

    #: what the run trains, in its record (`nbtrain.runs.RUN_KINDS`): a recipe sets its own
    kind = "sft"
    #: an MoE's router loss, where the run adds it (`nbtrain.losses.router`; set by the set-up)
    router_aux: Any = None

    # filled in by the set-up (`nbtrain.recipes.run_setup`), read by the loop, the saves and hooks
    d: Any  #: the process group as the run sees it (`nbtrain.engine.dist.Dist`)
    tokenizer: Any
    model: Any  #: what the step runs (DDP around `peft_model`, unsharded on several ranks)
    peft_model: Any  #: the peft model being trained (this rank's shard of it under fsdp)
    compute_dtype: Any
    loss_fn: Any
    quantized: bool
    use_cache: Any
    plan: Any  #: the batch plan (`nbtrain.data.batch.BatchPlan`)
    eval_rows: Any
    batches: Any
    evals: Any
    n_eval: int  #: eval forwards each rank runs (the most any rank has, under fsdp)
    micro0: Any  #: a stand-in micro-batch for a rank short of eval batches
    spe: int  #: steps per epoch
    span: Any  #: the run's steps in the data (`nbtrain.recipes.span.Span`)
    start_step: int
    total_steps: int
    resumed: dict[str, Any] | None
    resume_from: str | None
    trainable: list[Any]
    optimizer: Any
    scheduler: Any
    # filled in by the loop (`nbtrain.recipes.loop`)
    meter: Any
    grad_norm: Any
    last_saved: int
    preemption: Any
    held: Any

    def __init__(
        self, cfg: SFTConfig, merge: bool = False, group: Any = None, hooks: Hooks | None = None
    ) -> None:
        if not isinstance(cfg, SFTConfig):
            msg = f"finetune needs an nbtrain.SFTConfig, got {type(cfg).__name__}; build one with nbtrain.SFTConfig(...)"
            raise ConfigError(msg)
        self.cfg = cfg
        self.group = group
        # the settings the recipe itself uses, read here once; the modules it calls read their own
        self.out = Path(cfg.output_dir).expanduser()
        self.shard_kind = cfg.shard
        self.sharded = cfg.shard != "ddp"
        self.name = cfg.run_name or self.out.name
        self.config_dict = cfg.to_dict()
        self.model_name = cfg.model
        self.eval_data = cfg.eval_data
        self.data = cfg.data
        self.data_cache = cfg.data_cache
        self.template_kwargs = cfg.chat_template_kwargs
        self.auto_batch = cfg.per_device_train_batch_size == "auto"
        self.global_batch_size = cfg.global_batch_size
        self.max_length = cfg.max_length
        self.truncation_side = cfg.truncation_side
        self.packing = cfg.packing
        self.padding_free = cfg.padding_free
        self.seed = cfg.seed
        self.torch_compile = cfg.torch_compile
        self.overwrite = cfg.overwrite
        self.learning_rate = cfg.learning_rate
        self.lr_scheduler_type = cfg.lr_scheduler_type
        self.warmup_steps = cfg.warmup_steps
        self.clip = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
        self.logging_steps = cfg.logging_steps
        self.eval_steps = cfg.eval_steps
        self.save_steps = cfg.save_steps
        self.save_total_limit = cfg.save_total_limit
        # what the set-up fills in
        self.runlog: RunLog | None = None
        self.history: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.levers: list[str] = []
        self.merge = merge
        # the caller's hooks and the run's own (samples while training) in a copy of its object
        self.hooks = hooks.copy() if hooks is not None else Hooks()
        if cfg.sample_prompts is not None:
            Sampler(cfg).attach(self.hooks)
        # what the loop and the saves fill in
        self.step = 0
        self.state = "failed"
        #: (the rank that got the signal, the signal) once a preemption reached the step's collective
        self.preempted: tuple[int, int] | None = None
        self.adapter_dir: str | None = None
        self.merged_dir: str | None = None
        #: the checkpoint a preemption wrote, to resume from
        self.checkpoint: str | None = None

    def run(self) -> TrainResult:
        """Set up, train, and return the result: what `finetune` does."""
        # an interrupt during set-up (whose ranks meet in collectives too) is held to the first step
        with interrupts.Held():
            self.setup()
            self.train()
        return self.result()

    # ---- what the set-up and every step use

    def autocast(self) -> Any:
        """The context the model computes in: autocast to the compute dtype, where there is one."""
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        import torch

        return torch.autocast(device_type=self.d.device.type, dtype=self.compute_dtype)

    def loss_sum(self, net: Any, batch: dict[str, Any], aux: Any = None) -> Any:
        """The summed token loss of `batch` through `net` (the set-up's batch probe, SFT's step);
        `aux`: keep an MoE's router loss too (`nbtrain.losses.router.RouterAux`)."""
        # through the module, so a test can wrap nbtrain.recipes.step.loss_sum to slow or kill a rank mid-step
        return one_step.loss_sum(net, batch, self.autocast, self.loss_fn, aux)

    # ---- the contract: each recipe writes these in its own file

    @abstractmethod
    def setup(self) -> None:
        """Everything that can be wrong, found on every rank before any write; then output_dir."""

    @abstractmethod
    def train(self) -> None:
        """The loop over the recipe's own step (`nbtrain.recipes.loop.train`)."""

    @abstractmethod
    def train_step(self) -> bool:
        """One optimizer step with its log row and checkpoint; False where the run stops before it."""

    @abstractmethod
    def log(self, row: dict[str, Any]) -> None:
        """The recipe's figures added to a logged row, then `nbtrain.recipes.loop.record`."""

    @abstractmethod
    def eval_metrics(self) -> dict[str, float]:
        """What an evaluation adds to the log row (`eval_loss` at least)."""

    @abstractmethod
    def save_checkpoint(self, step: int) -> None:
        """An atomic checkpoint of step `step` in output_dir."""

    @abstractmethod
    def export(self) -> None:
        """The adapter (and with merge=True the merged model) in output_dir."""

    @abstractmethod
    def cleanup(self) -> None:
        """Put back what the run changed (signal handlers, the live display) and record its end."""

    @abstractmethod
    def result(self) -> TrainResult:
        """The `TrainResult` of the run on this rank."""
