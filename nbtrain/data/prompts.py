"""Prompts as given to generation: strings, message lists, rows or a file of them, read and checked
before any engine loads a model (`SFTConfig.sample_prompts`, `nbtrain.generate`, GRPO's prompt rows).

Moved here from generation/decode.py so that `SFTConfig`'s checks (configs/) read prompts without
importing generation, a layer above them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nbtrain.data.sources import SUFFIXES, Source
from nbtrain.errors import ConfigError

log = logging.getLogger(__name__)

_ACCEPTED = (
    "a string, a list of {'role', 'content'} messages, a row dict with 'prompt' (and optionally "
    "'completion'), 'messages' or 'text', or a .jsonl/.json/.parquet/.csv file of such rows"
)


@dataclass
class Entry:
    """One prompt as read, before tokenization."""

    prompt: Any  #: a string or a list of messages, as given
    reference: str | None = None  #: the row's completion, where it has one
    tools: Any = None
    template_kwargs: dict | None = None


# ------------------------------------------------------------------------------------------ reading
def _is_messages(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and "role" in m for m in value)
    )


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # {'type': 'text', 'text': ...} parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _from_row(row: dict, where: str) -> Entry:
    tools, kwargs = row.get("tools"), row.get("chat_template_kwargs")
    if "prompt" in row:
        p = row["prompt"]
        if not (isinstance(p, str) or _is_messages(p)):
            msg = f"{where}: 'prompt' must be a string or a list of {{'role', 'content'}} messages, got {type(p).__name__}"
            raise ConfigError(msg)
        c = row.get("completion")
        ref = None
        if isinstance(c, str):
            ref = c
        elif c is not None and _is_messages(c):
            ref = "\n".join(_text(m.get("content")) for m in c if m.get("role") == "assistant")
        return Entry(p, ref, tools, kwargs)
    if "messages" in row:
        m = row["messages"]
        if not _is_messages(m):
            msg = f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} dicts"
            raise ConfigError(msg)
        # the conversation up to its last assistant turn is the prompt, that turn the reference
        last = max((i for i, x in enumerate(m) if x["role"] == "assistant"), default=None)
        if last is None:
            return Entry(m, None, tools, kwargs)
        if last == 0:
            msg = f"{where}: 'messages' starts with the assistant turn, so it leaves no prompt; give a user turn first"
            raise ConfigError(msg)
        return Entry(m[:last], _text(m[last].get("content")), tools, kwargs)
    if isinstance(row.get("text"), str):
        return Entry(row["text"])
    keys = ", ".join(repr(k) for k in row) or "none"
    msg = f"{where} is not a prompt: keys found {keys}; give {_ACCEPTED}"
    raise ConfigError(msg)


def _is_file(value: Any) -> bool:
    """A path, or a string that names a data file: it exists, or it has a data file's suffix and no
    whitespace ("What is in data.csv?" stays a prompt)."""
    if isinstance(value, os.PathLike):
        return True
    if not isinstance(value, str) or not value.lower().endswith(SUFFIXES):
        return False
    return not any(c.isspace() for c in value) or Path(value).expanduser().is_file()


def read_prompts(prompts: Any, name: str = "prompts") -> list[Entry]:
    """Every prompt of `prompts` (see `_ACCEPTED`), with its reference where a row has a completion;
    a ConfigError naming the bad one and what to give instead."""
    if prompts is None:
        msg = f"{name} is required: give {_ACCEPTED}"
        raise ConfigError(msg)
    single = isinstance(prompts, str) and not _is_file(prompts)
    if single or _is_messages(prompts) or isinstance(prompts, dict):
        prompts = [prompts]  # one prompt
    if _is_file(prompts):
        path = Path(prompts).expanduser()
        if not path.is_file():
            msg = f"{name} file {os.fspath(prompts)!r} not found; check the path (relative paths are from {os.getcwd()})"
            raise ConfigError(msg)
    rows: list[tuple[Any, str]]
    if isinstance(prompts, str | os.PathLike) or hasattr(prompts, "columns"):
        src = Source(prompts, name)
        rows = [(r.value, src.row_where(r)) for r in src.part(0, 1)]
    elif hasattr(prompts, "column_names"):  # a datasets.Dataset
        rows = [(r, f"{name} row {i}") for i, r in enumerate(prompts.to_list())]
    elif isinstance(prompts, Sequence):
        rows = [(r, f"{name}[{i}]") for i, r in enumerate(prompts)]
    else:
        msg = f"{name} of type {type(prompts).__name__} is not supported; give {_ACCEPTED}, or a list of them"
        raise ConfigError(msg)
    out: list[Entry] = []
    for value, where in rows:
        if isinstance(value, str):
            out.append(Entry(value))
        elif _is_messages(value):
            out.append(Entry(value))
        elif isinstance(value, dict):
            out.append(_from_row(value, where))
        else:
            msg = f"{where} is a {type(value).__name__}; give {_ACCEPTED}"
            raise ConfigError(msg)
    if not out:
        msg = f"{name} holds no prompts; give at least one ({_ACCEPTED})"
        raise ConfigError(msg)
    return out


def sampling_problems(cfg: Any) -> list[str]:
    """What is wrong with sample_prompts / sample_steps / sample_max_new_tokens; a prompts file is read
    here, so a bad row stops the run before any engine loads a model."""
    problems: list[str] = []
    for name in ("sample_steps", "sample_max_new_tokens"):
        value = getattr(cfg, name)
        if value is None and name == "sample_steps":
            continue
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            problems.append(f"{name}={value!r} must be an integer >= 1")
    if cfg.sample_prompts is None:
        if cfg.sample_steps is not None:
            problems.append(
                f"sample_steps={cfg.sample_steps!r} needs sample_prompts, which is None; pass the prompts "
                "to sample (a list of strings or a .jsonl file) or drop sample_steps"
            )
        return problems
    if isinstance(cfg.sample_prompts, os.PathLike):
        cfg.sample_prompts = os.fspath(cfg.sample_prompts)
    try:
        read_prompts(cfg.sample_prompts, "sample_prompts")
    except ConfigError as e:
        problems.append(str(e))
    return problems


def shown(prompt: Any) -> str:
    """A prompt as one string for a table or samples.jsonl: a message list as 'role: content' lines."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m.get('role')}: {_text(m.get('content'))}" for m in prompt)
