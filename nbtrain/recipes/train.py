"""`finetune`: LoRA supervised fine-tuning that runs on every rank, in a plain process or on a cluster.

In [1]: %%distributed
   ...: cfg = nbtrain.SFTConfig(model="tiny-llama", data="train.jsonl", output_dir="runs/first",
   ...:                         max_steps=200, per_device_train_batch_size=4)
   ...: result = nbtrain.finetune(cfg)
In [2]: result.history.plot(x="step", y="loss")

`finetune` is the public call; the run itself is a recipe (`nbtrain.recipes.base.Recipe`: set-up, train,
save), `nbtrain.recipes.sft.SFTRecipe` for an SFTConfig, whose loop takes hooks (`nbtrain.recipes.hooks`).
"""

from __future__ import annotations

import logging
from typing import Any

from nbtrain.configs.sft import SFTConfig
from nbtrain.recipes.base import Recipe
from nbtrain.recipes.hooks import Hooks
from nbtrain.recipes.saves import TrainResult
from nbtrain.recipes.sft import SFTRecipe

log = logging.getLogger(__name__)

__all__ = ["Hooks", "TrainResult", "finetune", "recipe_for"]


def finetune(
    cfg: SFTConfig, merge: bool = False, group: Any = None, hooks: Hooks | None = None
) -> TrainResult:
    """Fine-tune `cfg.model` with LoRA on `cfg.data`, on every rank; export the adapter on rank 0.

    In [1]: result = nbtrain.finetune(nbtrain.SFTConfig(model="tiny", data="train.jsonl", max_steps=50))
    In [2]: result.history.tail()

    Bad settings or data raise `ConfigError` on every rank before any step, and nothing is written to
    `output_dir`. `merge=True` also writes the merged model to `output_dir/merged`.

    `group` trains on a sub-group of the running process group instead of the whole world (e.g.
    `groups["actor"]` in a `%%distributed --group actor` cell): its ranks are the run's ranks 0..n-1,
    and it trains exactly as a cluster of that many ranks would. Call it on the group's ranks only.

    `hooks` (`nbtrain.recipes.hooks.Hooks`) are called in the loop: on_step, on_eval, on_log, on_save.

    An `nbtrain.DPOConfig` runs DPO on preference pairs instead (`nbtrain.recipes.dpo.DPORecipe`), an
    `nbtrain.GRPOConfig` GRPO on prompts and reward functions (`nbtrain.recipes.grpo.recipe.GRPORecipe`).
    """
    return recipe_for(cfg, merge=merge, group=group, hooks=hooks).run()


def recipe_for(
    cfg: SFTConfig, merge: bool = False, group: Any = None, hooks: Hooks | None = None
) -> Recipe:
    """The recipe `cfg`'s type names (SFT, DPO or GRPO), not yet set up: the one place that picks it,
    for `finetune` and `nbtrain.Run`."""
    from nbtrain.configs.dpo import DPOConfig
    from nbtrain.configs.grpo import GRPOConfig

    if isinstance(cfg, GRPOConfig):
        from nbtrain.recipes.grpo.recipe import GRPORecipe

        return GRPORecipe(cfg, merge=merge, group=group, hooks=hooks)
    if isinstance(cfg, DPOConfig):
        from nbtrain.recipes.dpo import DPORecipe

        return DPORecipe(cfg, merge=merge, group=group, hooks=hooks)
    return SFTRecipe(cfg, merge=merge, group=group, hooks=hooks)
