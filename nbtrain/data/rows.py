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
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from nbtrain.data import chat
from nbtrain.data.sources import Source
from nbtrain.errors import ConfigError

log = logging.getLogger(__name__)

IGNORE = -100
FORMATS = ("prompt/completion", "messages", "text")
TRUNCATION_SIDES = ("right", "left")
_ACCEPTED = "'prompt' + 'completion', 'messages' (a list of {'role', 'content'}), or 'text'"
# rows per tokenizer call: fast tokenizers encode a list in parallel
_CHUNK = 1000


# --------------------------------------------------------------------------------------------- loading
def load_rows(source: Any, name: str = "data") -> list[dict]:
    """Every row of `source` as a list of dicts; a ConfigError for files that are missing or malformed.

    Small data only (evaluation rows, tests): training data is read a part per rank (tokens.prepare).
    """
    src = Source(source, name)
    rows = []
    for r in src.part(0, 1):
        try:
            row_format(r.value, r.local, src.where)
        except ConfigError:  # again, naming the line an editor shows (counted only now)
            row_format(r.value, r.local, src.row_where(r))
            raise
        rows.append(r.value)
    if not rows:
        msg = f"{src.where} has no rows; give at least one row with {_ACCEPTED}"
        raise ConfigError(msg)
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


def alike(row: Any) -> str | None:
    """What to say when every row of the data is refused as `row` is, where its keys are why ("all
    40 rows have keys 'input', 'output'; SFT rows need ..."); None for any other fault."""
    if not isinstance(row, dict) or ("prompt" in row and "completion" in row) or "messages" in row:
        return None
    if isinstance(row.get("text"), str):
        return None
    keys = ", ".join(repr(k) for k in row) or "none"
    pairs = "chosen" in row and "rejected" in row
    hint = "; they are preference pairs: nbtrain.DPOConfig trains on them" if pairs else ""
    return f"have keys {keys}; SFT rows need {_ACCEPTED}{hint}"


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


def _as_text(row: dict, tokenizer: Any, template_kwargs: dict | None = None) -> _Text:
    fmt = row_format(row)
    if fmt == "text":
        return _Text(row["text"], [(0, len(row["text"]))], True, True)
    if fmt == "prompt/completion" and isinstance(row["prompt"], str):
        p, c = row["prompt"], row["completion"]
        return _Text(p + c, [(len(p), len(p) + len(c))], True, True)
    # TRL's per-row keys: tools the template lists, and its arguments (Qwen3's enable_thinking)
    tools, kwargs = row.get("tools"), row.get("chat_template_kwargs")
    if template_kwargs:  # SFTConfig(chat_template_kwargs=...) for every row; a row's own win
        kwargs = {**template_kwargs, **(kwargs or {})}
    if isinstance(tools, str):
        tools = json.loads(tools)
    if fmt == "messages":
        full, spans = chat.conversation(tokenizer, row["messages"], tools, kwargs)
    else:
        full, spans = chat.prompt_completion(
            tokenizer, row["prompt"], row["completion"], tools, kwargs
        )
    return _Text(full, spans, False, False)


def _trained_from_offsets(offsets: Any, spans: list[tuple[int, int]]) -> Any:
    """1 for each token that holds any trained character, else 0 (uint8)."""
    import numpy as np

    off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    s, e = off[:, 0], off[:, 1]
    trained = np.zeros(len(off), dtype=bool)
    # a token is trained when it holds any trained character: one that straddles the prompt's end
    # (" tac" after "Answer:") carries completion text the model must produce
    for a, b in spans:
        trained |= (e > s) & (s < b) & (e > a)
    return trained.astype(np.uint8)


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


def _backend(tokenizer: Any) -> Any:
    """The fast tokenizer's Rust backend, where calling it directly gives what the wrapper gives: no
    truncation or padding configured on it, special tokens encoded as the wrapper would."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if tokenizer.is_fast else None
    if backend is None or backend.truncation is not None or backend.padding is not None:
        return None
    if backend.encode_special_tokens != bool(getattr(tokenizer, "split_special_tokens", False)):
        return None
    return backend


def _trained_tokens(enc: Any, spans: list[tuple[int, int]], n: int) -> Any:
    """1 for each token of a backend Encoding that holds a trained character, from the tokens that
    hold each span's first and last characters; None where a span's end maps to no token."""
    import numpy as np

    trained = np.zeros(n, dtype=np.uint8)
    for a, b in spans:
        if b <= a:
            continue
        lo, hi = enc.char_to_token(a), enc.char_to_token(b - 1)
        if lo is None or hi is None:
            return None
        trained[lo : hi + 1] = 1
    return trained


def _tokenize(tokenizer: Any, texts: list[_Text]) -> list[tuple[Any, Any]]:
    """(input_ids int32, trained uint8) of each text, in order: one batched tokenizer call per kind.

    Fast tokenizers are called through their backend, and a span's tokens found from the tokens of
    its end characters: the per-token offsets the wrapper would build as Python tuples are the
    larger part of tokenizing a big data set."""
    import numpy as np

    fast = getattr(tokenizer, "is_fast", False)
    backend = _backend(tokenizer) if fast else None
    out: list[Any] = [None] * len(texts)
    for special in (True, False):
        group = [j for j, t in enumerate(texts) if t.special == special]
        if not group:
            continue
        if backend is not None:
            encs = backend.encode_batch([texts[j].text for j in group], add_special_tokens=special)
            for j, enc in zip(group, encs, strict=True):
                ids = np.asarray(enc.ids, dtype=np.int32)
                trained = _trained_tokens(enc, texts[j].spans, len(ids))
                if trained is None:  # a character no token holds (normalised away): use offsets
                    trained = _trained_from_offsets(enc.offsets, texts[j].spans)
                out[j] = (ids, trained)
            continue
        enc = tokenizer(
            [texts[j].text for j in group],
            add_special_tokens=special,
            return_offsets_mapping=fast,
            return_attention_mask=False,
        )
        for k, j in enumerate(group):
            ids = np.asarray(enc["input_ids"][k], dtype=np.int32)
            if fast:
                trained = _trained_from_offsets(enc["offset_mapping"][k], texts[j].spans)
            else:
                labels = _labels_from_prefixes(tokenizer, texts[j], ids.tolist())
                trained = (np.asarray(labels) != IGNORE).astype(np.uint8)
            out[j] = (ids, trained)
    return out


def encode_batch(
    rows: Sequence[Any], tokenizer: Any, template_kwargs: dict | None = None
) -> list[Any]:
    """Each row as (input_ids int32, trained uint8) arrays, untruncated, or the ConfigError that
    refuses it (`row_problem` words it with the row's place)."""
    import numpy as np

    eos = tokenizer.eos_token_id
    out: list[Any] = [None] * len(rows)
    texts: list[tuple[int, _Text]] = []
    for j, row in enumerate(rows):
        try:
            texts.append((j, _as_text(row, tokenizer, template_kwargs)))
        except ConfigError as e:
            out[j] = e
    encoded = _tokenize(tokenizer, [t for _, t in texts])
    for (j, t), (ids, trained) in zip(texts, encoded, strict=True):
        if t.eos and eos is not None:
            if len(ids) and ids[-1] == eos:
                trained[-1] = 1  # a tokenizer that appends eos itself
            else:
                ids = np.append(ids, np.int32(eos))
                trained = np.append(trained, np.uint8(1))
        out[j] = (ids, trained)
    return out


def row_problem(
    row: Any, tokenizer: Any, index: int, where: str, template_kwargs: dict | None = None
) -> str:
    """Why `row` is refused, naming `where` (file and line) and its index, with the fix."""
    try:
        row_format(row, index, where)
        _as_text(row, tokenizer, template_kwargs)
    except ConfigError as e:
        text = str(e)
        return text if text.startswith(where) else f"{where} row {index}: {text}"
    return f"{where} row {index}: refused"  # not reached: encode_batch refused it for a reason


def to_example(ids: Any, trained: Any) -> Example:
    """Arrays from `encode_batch` (or the token cache) as an Example."""
    import numpy as np

    return Example(ids.tolist(), np.where(trained.astype(bool), ids, IGNORE).tolist())


def cut(ids: Any, trained: Any, max_length: int | None, side: str) -> tuple[Any, Any, bool]:
    """`ids` and `trained` cut to `max_length` tokens at `side`; whether anything was cut."""
    if max_length is None or len(ids) <= max_length:
        return ids, trained, False
    keep = slice(0, max_length) if side == "right" else slice(len(ids) - max_length, None)
    return ids[keep], trained[keep], True


def encode_rows(
    rows: Sequence[dict],
    tokenizer: Any,
    max_length: int | None,
    *,
    truncation_side: str = "right",
    where: str = "data",
    indices: Sequence[int] | None = None,
    template_kwargs: dict | None = None,
) -> tuple[list[Example], list[int]]:
    """Tokenize `rows` with their loss masks; also the indices of the rows cut at `max_length`.

    `indices` are the rows' numbers in the data (for error messages); `max_length` None cuts nothing.
    A row the tokenizer or chat template cannot handle is a ConfigError naming its index and the fix.
    Rows held in memory: training data goes through the token cache (tokens.prepare) instead.
    """
    indices = list(range(len(rows))) if indices is None else list(indices)
    examples: list[Example] = []
    truncated: list[int] = []
    for start in range(0, len(rows), _CHUNK):
        chunk = rows[start : start + _CHUNK]
        for j, res in enumerate(encode_batch(chunk, tokenizer, template_kwargs)):
            i = indices[start + j]
            if isinstance(res, ConfigError):
                msg = row_problem(chunk[j], tokenizer, i, where, template_kwargs)
                raise ConfigError(msg) from None
            ids, trained, was_cut = cut(res[0], res[1], max_length, truncation_side)
            if was_cut:
                truncated.append(i)
            examples.append(to_example(ids, trained))
    return examples, truncated


def encode_row(
    row: dict, tokenizer: Any, max_length: int | None, truncation_side: str = "right"
) -> Example:
    """Tokenize one row with its loss mask, cut to `max_length` tokens (None: not cut)."""
    return encode_rows([row], tokenizer, max_length, truncation_side=truncation_side)[0][0]
