"""Training rows: loading, format checks, and tokenization with a loss mask.

Rows come in the three formats TRL users know: ``prompt``/``completion`` (strings, or lists of chat
messages), ``messages`` (rendered with the tokenizer's chat template) and ``text``. The loss covers only the
completion or assistant tokens of the first two, every token of ``text``.

Each row is tokenized in one call, as one text, and the loss mask comes from character offsets: a
SentencePiece tokenizer that adds "▁" at the start of every call (Llama-2, Mistral v0.x, Phi-3) would
otherwise train a first completion token the model never sees after that prompt.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nbtrain.errors import ConfigError
from nbtrain.sft import chat

IGNORE = -100
FORMATS = ("prompt/completion", "messages", "text")
TRUNCATION_SIDES = ("right", "left")
_ACCEPTED = "'prompt' + 'completion', 'messages' (a list of {'role', 'content'}), or 'text'"
# rows per tokenizer call: fast tokenizers encode a list in parallel
_CHUNK = 1000
# fewer rows than this tokenize in a second or two: no progress bar
_PROGRESS_ROWS = 20_000


# --------------------------------------------------------------------------------------------- loading
def _plain(value: Any) -> Any:
    """numpy/pandas values (from DataFrames and Parquet) as plain Python, NaN as None."""
    if hasattr(value, "tolist") and not isinstance(value, str):
        value = value.tolist()
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _records(frame: Any) -> list[dict]:
    rows = frame.to_dict(orient="records")
    # a CSV or DataFrame mixing formats has NaN where a row lacks a column: treat it as absent
    return [
        {k: v for k, v in ((k, _plain(v)) for k, v in row.items()) if v is not None} for row in rows
    ]


def _read_jsonl(path: Path, name: str) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                msg = (
                    f"{name} file {str(path)!r}: line {lineno} is not valid JSON ({e.msg} at column "
                    f"{e.colno}); fix or remove that line"
                )
                raise ConfigError(msg) from None
    return rows


def load_rows(source: Any, name: str = "data") -> list[dict]:
    """Every row of `source` as a list of dicts; a ConfigError for files that are missing or malformed."""
    if isinstance(source, str | os.PathLike):
        path = Path(source).expanduser()
        if not path.is_file():
            msg = f"{name} file {os.fspath(source)!r} not found; check the path (relative paths are from {os.getcwd()})"
            raise ConfigError(msg)
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            rows = _read_jsonl(path, name)
        elif suffix == ".json":
            text = path.read_text(encoding="utf-8")
            stripped = text.lstrip()
            if stripped.startswith("["):
                try:
                    rows = json.loads(text)
                except json.JSONDecodeError as e:
                    msg = f"{name} file {str(path)!r}: invalid JSON at line {e.lineno}, column {e.colno} ({e.msg}); fix that line"
                    raise ConfigError(msg) from None
            else:  # JSON lines saved as .json
                rows = _read_jsonl(path, name)
        elif suffix == ".parquet":
            import pandas as pd

            rows = _records(pd.read_parquet(path))
        elif suffix == ".csv":
            import pandas as pd

            rows = _records(pd.read_csv(path))
        else:
            msg = f"{name} file {str(path)!r} has an unknown suffix; use .jsonl, .json, .parquet or .csv"
            raise ConfigError(msg)
        where = f"{name} file {str(path)!r}"
    elif hasattr(source, "to_dict") and hasattr(source, "columns"):  # pandas DataFrame
        rows = _records(source)
        where = f"{name} DataFrame"
    elif hasattr(source, "to_list") and hasattr(source, "column_names"):  # datasets.Dataset
        rows = [_plain(r) for r in source.to_list()]
        where = f"{name} Dataset"
    elif isinstance(source, Sequence) and not isinstance(source, str | bytes):
        rows = list(source)
        where = f"{name} list"
    else:
        msg = (
            f"{name} of type {type(source).__name__} is not supported; pass a .jsonl/.json/.parquet/.csv "
            "path, a list of dicts, a pandas DataFrame or a datasets.Dataset"
        )
        raise ConfigError(msg)
    if not rows:
        msg = f"{where} has no rows; give at least one row with {_ACCEPTED}"
        raise ConfigError(msg)
    for i, row in enumerate(rows):
        row_format(row, i, where)
    return rows


def _is_messages(value: Any) -> bool:
    # content is checked with the template (chat.normalise); a tool-calling turn may have none
    return (
        isinstance(value, list)
        and bool(value)
        and all(
            isinstance(m, dict) and "role" in m and ("content" in m or "tool_calls" in m)
            for m in value
        )
    )


def row_format(row: Any, index: int = 0, where: str = "data") -> str:
    """Which of the three formats `row` is in; a ConfigError naming the row, its keys and the formats."""
    if isinstance(row, dict):
        if "prompt" in row and "completion" in row:
            p, c = row["prompt"], row["completion"]
            if (isinstance(p, str) and isinstance(c, str)) or (_is_messages(p) and _is_messages(c)):
                return "prompt/completion"
            msg = (
                f"{where} row {index}: 'prompt' and 'completion' must both be strings or both be lists of "
                f"{{'role', 'content'}} messages, got {type(p).__name__} and {type(c).__name__}"
            )
            raise ConfigError(msg)
        if "messages" in row:
            m = row["messages"]
            if _is_messages(m) and any(x["role"] == "assistant" for x in m):
                return "messages"
            msg = (
                f"{where} row {index}: 'messages' must be a non-empty list of {{'role', 'content'}} dicts "
                "with at least one 'assistant' turn (the loss is on assistant tokens)"
            )
            raise ConfigError(msg)
        if "text" in row and isinstance(row["text"], str):
            return "text"
        keys = ", ".join(repr(k) for k in row) or "none"
    else:
        keys = f"none (the row is a {type(row).__name__}, not a dict)"
    msg = f"{where} row {index} is in none of the known formats: keys found {keys}; each row needs {_ACCEPTED}"
    raise ConfigError(msg)


# ---------------------------------------------------------------------------------------- tokenization
@dataclass
class Example:
    """One tokenized row or packed block: `labels` is `input_ids` with IGNORE where no loss is taken.

    `position_ids` restart at 0 where a sequence starts (once for a row, once per document in a packed
    block); the model attends only within a sequence, and the token at position 0 is never a target.
    """

    input_ids: list[int]
    labels: list[int]
    position_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.position_ids:
            self.position_ids = list(range(len(self.input_ids)))

    @property
    def n_targets(self) -> int:
        # a sequence's first token is never predicted: nothing before it in its sequence (causal shift)
        return sum(
            1 for t, p in zip(self.labels, self.position_ids, strict=True) if t != IGNORE and p != 0
        )


@dataclass
class _Text:
    """A row as one text: the character spans the loss covers, and how to tokenize it."""

    text: str
    spans: list[tuple[int, int]]
    special: bool  # the tokenizer adds its special tokens (BOS); chat templates write their own
    eos: bool  # end with a trained eos token (so the model learns to stop)


def _as_text(row: dict, tokenizer: Any) -> _Text:
    fmt = row_format(row)
    if fmt == "text":
        return _Text(row["text"], [(0, len(row["text"]))], True, True)
    if fmt == "prompt/completion" and isinstance(row["prompt"], str):
        p, c = row["prompt"], row["completion"]
        return _Text(p + c, [(len(p), len(p) + len(c))], True, True)
    # TRL's per-row keys: tools the template lists, and its arguments (Qwen3's enable_thinking)
    tools, kwargs = row.get("tools"), row.get("chat_template_kwargs")
    if isinstance(tools, str):
        tools = json.loads(tools)
    if fmt == "messages":
        full, spans = chat.conversation(tokenizer, row["messages"], tools, kwargs)
    else:
        full, spans = chat.prompt_completion(
            tokenizer, row["prompt"], row["completion"], tools, kwargs
        )
    return _Text(full, spans, False, False)


def _labels_from_offsets(
    ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]]
) -> list[int]:
    # a token is trained when it holds any trained character: one that straddles the prompt's end
    # (" tac" after "Answer:") carries completion text the model must produce
    return [
        t if e > s and any(s < b and e > a for a, b in spans) else IGNORE
        for t, (s, e) in zip(ids, offsets, strict=True)
    ]


def _labels_from_prefixes(tokenizer: Any, t: _Text, ids: list[int]) -> list[int]:
    """Slow tokenizers have no offsets: find each span's tokens by tokenizing the text up to its ends."""

    def agree(end: int) -> tuple[int, bool]:
        pre = tokenizer(t.text[:end], add_special_tokens=t.special)["input_ids"]
        n = 0
        while n < min(len(pre), len(ids)) and pre[n] == ids[n]:
            n += 1
        return n, n < len(pre)  # tokens before `end`; whether the next one straddles it

    labels = [IGNORE] * len(ids)
    for a, b in t.spans:
        lo, _ = agree(a)
        hi, straddles = agree(b) if b < len(t.text) else (len(ids), False)
        for j in range(lo, min(hi + straddles, len(ids))):
            labels[j] = ids[j]
    return labels


def _tokenize(tokenizer: Any, texts: list[_Text]) -> Iterator[tuple[list[int], list[int]]]:
    """(input_ids, labels) of each text, from one tokenizer call per text."""
    fast = getattr(tokenizer, "is_fast", False)
    for special in (True, False):
        group = [t for t in texts if t.special == special]
        if not group:
            continue
        enc = tokenizer(
            [t.text for t in group], add_special_tokens=special, return_offsets_mapping=fast
        )
        for j, t in enumerate(group):
            ids = list(enc["input_ids"][j])
            if fast:
                labels = _labels_from_offsets(ids, enc["offset_mapping"][j], t.spans)
            else:
                labels = _labels_from_prefixes(tokenizer, t, ids)
            yield ids, labels


def encode_rows(
    rows: Sequence[dict],
    tokenizer: Any,
    max_length: int | None,
    *,
    truncation_side: str = "right",
    where: str = "data",
    indices: Sequence[int] | None = None,
    progress: bool = False,
) -> tuple[list[Example], list[int]]:
    """Tokenize `rows` with their loss masks; also the indices of the rows cut at `max_length`.

    `indices` are the rows' numbers in the data (for error messages); `max_length` None cuts nothing.
    A row the tokenizer or chat template cannot handle is a ConfigError naming its index and the fix.
    """
    indices = list(range(len(rows))) if indices is None else list(indices)
    eos = tokenizer.eos_token_id
    examples: list[Example] = []
    truncated: list[int] = []
    bar = None
    if progress and len(rows) >= _PROGRESS_ROWS:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(rows), desc=f"tokenizing {where}", unit="rows")
    try:
        for start in range(0, len(rows), _CHUNK):
            texts = []
            for i, row in zip(indices[start : start + _CHUNK], rows[start : start + _CHUNK]):
                try:
                    texts.append(_as_text(row, tokenizer))
                except ConfigError as e:
                    msg = f"{where} row {i}: {e}"
                    raise ConfigError(msg) from None
            # keep the rows' order: the tokenizer is called per group (with or without special tokens)
            order = sorted(range(len(texts)), key=lambda j: not texts[j].special)
            encoded = dict(zip(order, _tokenize(tokenizer, texts), strict=True))
            for j, t in enumerate(texts):
                ids, labels = encoded[j]
                if t.eos and eos is not None:
                    if ids and ids[-1] == eos:
                        labels[-1] = eos  # a tokenizer that appends eos itself
                    else:
                        ids.append(eos)
                        labels.append(eos)
                if max_length is not None and len(ids) > max_length:
                    truncated.append(indices[start + j])
                    keep = (
                        slice(0, max_length)
                        if truncation_side == "right"
                        else slice(-max_length, None)
                    )
                    ids, labels = ids[keep], labels[keep]
                examples.append(Example(ids, labels))
            if bar is not None:
                bar.update(len(texts))
    finally:
        if bar is not None:
            bar.close()
    return examples, truncated


def encode_row(
    row: dict, tokenizer: Any, max_length: int | None, truncation_side: str = "right"
) -> Example:
    """Tokenize one row with its loss mask, cut to `max_length` tokens (None: not cut)."""
    return encode_rows([row], tokenizer, max_length, truncation_side=truncation_side)[0][0]
