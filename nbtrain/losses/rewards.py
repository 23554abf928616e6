"""How a GRPO reward function is called, TRL's way, and the check that each one can be, made before any
model loads.

TRL's `GRPOTrainer._calculate_rewards` calls every function with keywords only:
`f(prompts=..., completions=..., completion_ids=..., **columns)`, `columns` being the data's columns but
`prompt` (and `completion`, `completion_ids`), one list each; TRL also passes `trainer_state`,
`log_extra` and `log_metric`, which nbtrain does not. So a function must take those three names (or
`**kwargs`), every column it names must be in the data, and nothing else may be required.

In [1]: def correct(completions, solution, **kw): ...
In [2]: check([correct], ["correct"], [{"prompt": "2+2=", "answer": "4"}])
ConfigError: reward function 'correct(completions, solution, **kw)': it needs 'solution', a column the data does not have. ...
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from typing import Any

from nbtrain.errors import ConfigError

log = logging.getLogger(__name__)

#: the names every reward function is given, whatever the data
PASSED = ("prompts", "completions", "completion_ids")
#: what TRL passes besides, and nbtrain does not
TRL_ONLY = ("trainer_state", "log_extra", "log_metric", "environments")
#: row keys that are never passed as columns (TRL's list)
NOT_COLUMNS = ("prompt", "completion", "completion_ids")
CALL = "f(prompts=..., completions=..., completion_ids=..., **columns)"


def _signature(fn: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable: its call will tell
        return None


def problems(fn: Any, columns: Sequence[str] | None, some: Sequence[str] = ()) -> list[str]:
    """What stops `fn` from being called as TRL calls it: `columns` are those every row has (None: the
    data is not read yet, so columns a function names are not judged), `some` those only some rows have."""
    sig = _signature(fn)
    if sig is None:
        return []
    params = list(sig.parameters.values())
    named = {
        p.name
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    found: list[str] = []
    pos_only = [
        p.name
        for p in params
        if p.kind is inspect.Parameter.POSITIONAL_ONLY and p.default is inspect.Parameter.empty
    ]
    if pos_only:
        found.append(
            f"{_names(pos_only)} can only be given by position, and every argument comes by name"
        )
    given = [*PASSED, *(columns or ()), *some]
    if not any_keyword:
        unexpected = [k for k in given if k not in named]
        if unexpected:
            found.append(
                f"it takes no argument named {_names(unexpected)}, which the calls pass; add "
                "**kwargs to take what it does not use"
            )
    required = [
        p.name
        for p in params
        if p.name in named and p.default is inspect.Parameter.empty and p.name not in PASSED
    ]
    trl_only = [n for n in required if n in TRL_ONLY]
    if trl_only:
        found.append(
            f"it needs {_names(trl_only)}, which TRL passes and nbtrain does not; give "
            f"{'it' if len(trl_only) == 1 else 'them'} a default"
        )
    if columns is not None:
        partial = [n for n in required if n in some]
        if partial:
            found.append(
                f"it needs {_names(partial)}, which only some rows have; give every row "
                f"{'that column' if len(partial) == 1 else 'those columns'}"
            )
        absent = [n for n in required if n not in TRL_ONLY and n not in some and n not in columns]
        if absent:
            plural = len(absent) > 1
            found.append(
                f"it needs {_names(absent)}, {'columns' if plural else 'a column'} the data does not have"
            )
    return found


def columns_of(rows: Sequence[dict[str, Any]]) -> tuple[list[str], list[str], list[str]]:
    """The data's columns (in first-seen order), those every row has and those only some have (the
    last two without the keys that are never passed)."""
    seen: dict[str, int] = {}
    for row in rows:
        for k in row:
            seen[k] = seen.get(k, 0) + 1
    every = [k for k, n in seen.items() if n == len(rows) and k not in NOT_COLUMNS]
    some = [k for k, n in seen.items() if n < len(rows) and k not in NOT_COLUMNS]
    return list(seen), every, some


def check(
    funcs: Sequence[Any], names: Sequence[str], rows: Sequence[dict[str, Any]] | None
) -> None:
    """Raise `ConfigError`, naming each function that cannot be called as TRL calls a reward function
    on `rows` (None: the data is not read yet, so only what holds whatever the data is checked)."""
    if rows is None:
        every: list[str] | None = None
        some: list[str] = []
        has = ""
    else:
        keys, every, some = columns_of(rows)
        has = f"; the data's columns are {_names(keys)} (every one but 'prompt' is passed by name)"
    bad = []
    for fn, name in zip(funcs, names, strict=True):
        found = problems(fn, every, some)
        if found:
            bad.append(f"reward function '{name}{_signature(fn)}': {'; '.join(found)}")
    if bad:
        msg = f"{' / '.join(bad)}. TRL calls each reward function as {CALL}{has}"
        raise ConfigError(msg)


def _names(names: Sequence[str]) -> str:
    return ", ".join(repr(n) for n in names)


__all__ = ["CALL", "PASSED", "TRL_ONLY", "check", "columns_of", "problems"]
