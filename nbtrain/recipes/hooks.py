"""The recipe's extension points: functions called at named places of the training loop.

In [1]: hooks = nbtrain.recipes.hooks.Hooks()
In [2]: @hooks.on_log
   ...: def keep(recipe, row): rows.append(row)
In [3]: nbtrain.finetune(cfg, hooks=hooks)

A feature that needs the loop (sampling during training: `nbtrain.generation.sampling`) adds a hook here instead of
another branch in the loop. Every hook gets the recipe first (its model, optimizer, `Dist`, step) and then
keyword arguments, on every rank, in the order the hooks were added:

| hook | when | arguments |
|---|---|---|
| `on_begin` | once before the first step (of a new or a resumed run), in train mode | `step` (the step the run starts from) |
| `on_step` | after each optimizer step | `step`, `grad_norm`, `lr` (the rate the step used) |
| `on_eval` | after each evaluation | `step`, `eval_loss` |
| `on_log` | after each logged row (the row is in the history, the live plot and `metrics.jsonl`) | `row` |
| `on_save` | after each checkpoint is written (by rank 0, or by every rank's shards) | `step`, `checkpoint` |

An exception in a hook ends the run as any error in the loop does: the run is marked failed. A run
trained in spans (`nbtrain.Run`) calls `on_begin` once, at its first `train` call, and the others as its
steps come, whatever the spans.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from nbtrain.errors import ConfigError

log = logging.getLogger(__name__)

#: the loop's extension points, in the order a step reaches them
NAMES = ("on_begin", "on_step", "on_eval", "on_log", "on_save")

Hook = Callable[..., Any]


class Hooks:
    """Functions to call at the loop's named places (`NAMES`); each method also works as a decorator."""

    def __init__(self) -> None:
        self._fns: dict[str, list[Hook]] = {name: [] for name in NAMES}

    def add(self, name: str, fn: Hook) -> Hook:
        """Call `fn(recipe, **arguments)` at `name`; returns `fn`."""
        if name not in self._fns:
            msg = f"no hook named {name!r} in the training loop; the hooks are {', '.join(NAMES)}"
            raise ConfigError(msg)
        if not callable(fn):
            msg = f"hook {name} needs a function, got {type(fn).__name__}"
            raise ConfigError(msg)
        self._fns[name].append(fn)
        return fn

    def copy(self) -> Hooks:
        """The same hooks in a new object: a run adds its own (sampling) without touching the caller's."""
        new = Hooks()
        for name, fns in self._fns.items():
            new._fns[name] = list(fns)
        return new

    def on_begin(self, fn: Hook) -> Hook:
        return self.add("on_begin", fn)

    def on_step(self, fn: Hook) -> Hook:
        return self.add("on_step", fn)

    def on_eval(self, fn: Hook) -> Hook:
        return self.add("on_eval", fn)

    def on_log(self, fn: Hook) -> Hook:
        return self.add("on_log", fn)

    def on_save(self, fn: Hook) -> Hook:
        return self.add("on_save", fn)

    def call(self, name: str, recipe: Any, **info: Any) -> None:
        for fn in self._fns[name]:
            fn(recipe, **info)
