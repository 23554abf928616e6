"""Which charts a run gets, as the Lab draws them: every numeric metric, grouped by its prefix as
TensorBoard groups them, the most watched of the run's kind first, each axis titled with its unit
only where the unit is true.

In [1]: from nbtrain.plots import charts
In [2]: charts("dpo", ["loss", "eval_loss", "rewards/margins", "rewards/accuracies", "grad_norm"])
Out[2]: [Chart('loss', ('loss', 'eval_loss')), Chart('rewards/margins', ...), ...]
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: the groups in the order they are shown, after the kind's overview; others follow A-Z
GROUP_ORDER = (
    "loss",
    "eval",
    "reward",
    "rewards",
    "logps",
    "completions",
    "kl",
    "clip_ratio",
    "grad_norm",
    "learning_rate",
    "tokens_per_s",
    "mfu",
    "memory",
    "timings",
    "epoch",
)
#: keys of a row that are not charted: the x axes
NOT_CHARTED = ("step", "time")
#: never smoothed: a schedule, a count, a level
NEVER_SMOOTHED_GROUPS = ("learning_rate", "epoch", "memory", "mfu")
_REWARD_KEYS = ("reward", "reward_std", "frac_reward_zero_std")
_GRPO_FN = re.compile(r"rewards/[^/]+/mean$")


@dataclass(frozen=True)
class Chart:
    """One chart: its title and the row keys drawn on it (a run panel draws eval loss with loss)."""

    title: str
    keys: tuple[str, ...]


def group(key: str) -> str:
    """The group of a row key, as the Lab's: the part before the first "/" (rewards/margins ->
    rewards), eval_* -> eval, GRPO's reward statistics -> reward, per-rank memory -> memory,
    *_time and *_s timings -> timings, otherwise the key itself."""
    if key.startswith("eval_"):
        return "eval"
    if "/" in key:
        return key.split("/", 1)[0]
    if key in _REWARD_KEYS:
        return "reward"
    if key.startswith("peak_memory_gb"):
        return "memory"
    if key != "tokens_per_s" and (key.endswith("_time") or key.endswith("_s")):
        return "timings"
    return key


def unit(key: str, kind: str | None = "sft") -> str:
    """The y axis title of `key`: its unit where it has a true one (an SFT loss is nats/token, a
    DPO or GRPO loss has none: "loss"), else the key."""
    if key in ("loss", "eval_loss"):
        return "nats/token" if kind in (None, "sft", "finetune") else "loss"
    if key == "tokens_per_s":
        return "tokens/s"
    if key.startswith("peak_memory_gb"):
        return "GB"
    if key == "mfu":
        return "%"
    if group(key) == "timings":
        return "s"
    if key == "completions/mean_length":
        return "tokens"
    if key.startswith("logps/"):
        return "nats"
    return key


def smoothed(key: str, present: int = 1, rows: int = 1) -> bool:
    """Whether `key` may be smoothed: never a schedule or level (learning rate, epoch, memory, MFU),
    nor a series logged on fewer than half the rows (eval)."""
    return group(key) not in NEVER_SMOOTHED_GROUPS and present * 2 >= rows


def overview(kind: str | None, keys: Iterable[str]) -> list[Chart]:
    """The most watched charts of a run of `kind` whose rows have `keys`: SFT loss (eval loss on it)
    and eval loss; DPO loss, reward margin and accuracy; GRPO each reward function's mean, the
    mean reward, completion length, KL and loss."""
    have = list(dict.fromkeys(keys))
    with_eval = ("loss", "eval_loss") if "eval_loss" in have else ("loss",)
    out: list[Chart] = []
    if kind == "grpo":
        out += [Chart(k, (k,)) for k in have if _GRPO_FN.match(k)]
        out += [Chart(k, (k,)) for k in ("reward", "completions/mean_length", "kl", "loss")]
    elif kind == "dpo":
        out += [Chart("loss", with_eval), Chart("rewards/margins", ("rewards/margins",))]
        out.append(Chart("rewards/accuracies", ("rewards/accuracies",)))
    else:
        out.append(Chart("loss", with_eval))
    return [c for c in out if any(k in have for k in c.keys)]


def charts(kind: str | None, keys: Iterable[str]) -> list[Chart]:
    """Every chart of a run: the overview of its kind, then one chart per remaining key, by group
    in GROUP_ORDER (others A-Z), a per-rank memory group as one chart of all its keys."""
    have = [k for k in dict.fromkeys(keys) if k not in NOT_CHARTED]
    first = overview(kind, have)
    shown = {k for c in first for k in c.keys}
    rest = [k for k in have if k not in shown]
    order = {g: i for i, g in enumerate(GROUP_ORDER)}
    rest.sort(key=lambda k: (order.get(group(k), len(order)), group(k), k))
    out = list(first)
    memory = [k for k in rest if group(k) == "memory"]
    for k in rest:
        if group(k) == "memory":
            if k == memory[0]:
                out.append(Chart("peak memory", tuple(memory)))
            continue
        out.append(Chart(k, (k,)))
    return out


def numeric_keys(rows: Sequence[dict[str, object]]) -> list[str]:
    """The keys with a number in any row (bools and text are not metrics), in first-seen order."""
    seen: dict[str, None] = {}
    for row in rows:
        for k, v in row.items():
            if k not in seen and isinstance(v, int | float) and not isinstance(v, bool):
                seen[k] = None
    return list(seen)


__all__ = [
    "GROUP_ORDER",
    "NEVER_SMOOTHED_GROUPS",
    "NOT_CHARTED",
    "Chart",
    "charts",
    "group",
    "numeric_keys",
    "overview",
    "smoothed",
    "unit",
]
