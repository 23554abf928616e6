"""Training rows: loading, format checks, tokenization with a loss mask, sharding and batching.

Rows come in the three formats TRL users know: ``prompt``/``completion`` (strings, or lists of chat
messages), ``messages`` (rendered with the tokenizer's chat template) and ``text``. The loss covers only the
completion or assistant tokens of the first two, every token of ``text``.

Sharding: one global order per epoch, shuffled from ``seed``; rank r takes positions r, r+N, r+2N... and
tokenizes only the rows it takes. Micro-batch k of rank r then holds global positions
N*k*B ... N*(k+1)*B-1 across ranks, the same rows one rank with batch N*B sees, which is what makes N ranks
equal one.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nbtrain.errors import ConfigError

IGNORE = -100
FORMATS = ("prompt/completion", "messages", "text")
_ACCEPTED = "'prompt' + 'completion', 'messages' (a list of {'role', 'content'}), or 'text'"


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
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
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


def _render(tokenizer: Any, messages: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )


def _check_chat_template(tokenizer: Any) -> None:
    if not getattr(tokenizer, "chat_template", None):
        msg = (
            "rows in the 'messages' format need a tokenizer with a chat template, and this model's "
            "tokenizer has none; use an instruct/chat model, set tokenizer.chat_template, or convert the "
            "rows to prompt/completion"
        )
        raise ConfigError(msg)


def _chat_segments(tokenizer: Any, messages: list[dict]) -> list[tuple[str, bool]]:
    """The rendered conversation cut into (text, is_assistant) pieces."""
    full = _render(tokenizer, messages, False)
    segments: list[tuple[str, bool]] = []
    pos = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], True) if i else ""
        through = _render(tokenizer, messages[: i + 1], False)
        if not (full.startswith(before) and full.startswith(through)) or len(before) < pos:
            msg = (
                "the chat template does not render conversations prefix by prefix, so assistant tokens "
                "cannot be found; convert the rows to prompt/completion"
            )
            raise ConfigError(msg)
        segments.append((full[pos : len(before)], False))
        segments.append((full[len(before) : len(through)], True))
        pos = len(through)
    segments.append((full[pos:], False))
    return [s for s in segments if s[0]]


def encode_row(row: dict, tokenizer: Any, max_length: int | None) -> Example:
    """Tokenize one row with its loss mask, truncated to `max_length` tokens (None: not truncated)."""
    fmt = row_format(row)
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    labels: list[int] = []

    def add(text: str, train: bool, special: bool = False) -> None:
        toks = tokenizer(text, add_special_tokens=special)["input_ids"]
        ids.extend(toks)
        labels.extend(toks if train else [IGNORE] * len(toks))

    if fmt == "text":
        add(row["text"], True, special=True)
        if eos is not None and (not ids or ids[-1] != eos):
            ids.append(eos)
            labels.append(eos)
    elif fmt == "prompt/completion" and isinstance(row["prompt"], str):
        add(row["prompt"], False, special=True)
        add(row["completion"], True)
        if eos is not None and (not ids or ids[-1] != eos):
            ids.append(eos)
            labels.append(eos)
    else:
        _check_chat_template(tokenizer)
        if fmt == "messages":
            segments = _chat_segments(tokenizer, row["messages"])
        else:  # conversational prompt/completion
            prompt = _render(tokenizer, row["prompt"], True)
            full = _render(tokenizer, row["prompt"] + row["completion"], False)
            if not full.startswith(prompt):
                msg = "the chat template does not render the prompt as a prefix of the conversation; use string prompt/completion rows"
                raise ConfigError(msg)
            segments = [(prompt, False), (full[len(prompt) :], True)]
        for text, train in segments:
            add(text, train)
    if max_length is not None:
        ids, labels = ids[:max_length], labels[:max_length]
    return Example(ids, labels)


# ------------------------------------------------------------------------------------------- batching
def check_packed_attention() -> None:
    """A ConfigError when transformers cannot keep packed documents apart.

    Since 4.54 (huggingface/transformers#39194) transformers builds a block-diagonal causal mask from
    position_ids (SDPA, eager, flex) when the attention mask is None and there is no cache
    (masking_utils.find_packed_sequence_indices); before, SDPA and eager let every token of a packed row
    attend to all documents before it, and only flash attention read sequence starts from position_ids.
    """
    try:
        from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
    except ImportError:
        import transformers

        msg = (
            f"packing and padding_free need transformers >= 4.56 to keep packed documents from attending "
            f"to each other, and transformers {transformers.__version__} is installed; upgrade it "
            "(pip install -U transformers) or set packing=False and padding_free=False"
        )
        raise ConfigError(msg) from None


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The global shuffled order of `n` rows for one epoch: the same on every rank and world size."""
    import numpy as np

    return np.random.default_rng((seed, epoch)).permutation(n).tolist()


LAYOUTS = ("padded", "packed", "flat")


def collate(
    examples: Sequence[Example], pad_to: int, pad_id: int, layout: str = "padded"
) -> dict[str, Any]:
    """A micro-batch as tensors, in one of three layouts.

    - "padded": one row per example, right-padded to `pad_to` (the longest in the global micro-batch),
      with an attention mask.
    - "packed": one row per example (packed blocks), padded to `pad_to` with a pad sequence of its own;
      no attention mask, so the model builds a block-diagonal causal mask from `position_ids`.
    - "flat": the examples side by side in one row, no pad tokens, no attention mask (padding-free);
      flash attention's varlen path reads sequence starts from `position_ids` only in a 1-row batch.

    In every layout a token at position 0 starts a sequence and is never a target: without that, the
    first token of a document would be trained as the prediction from the previous document's last token.
    """
    import torch

    if layout not in LAYOUTS:
        msg = f"unknown batch layout {layout!r}; use one of {', '.join(LAYOUTS)}"
        raise ValueError(msg)
    if layout == "flat":
        ids = [t for ex in examples for t in ex.input_ids]
        labs = [t for ex in examples for t in ex.labels]
        pos = [p for ex in examples for p in ex.position_ids]
        input_ids = torch.tensor([ids], dtype=torch.long)
        labels = torch.tensor([labs], dtype=torch.long)
        position_ids = torch.tensor([pos], dtype=torch.long)
        mask = torch.ones_like(input_ids)
    else:
        b = len(examples)
        input_ids = torch.full((b, pad_to), pad_id, dtype=torch.long)
        labels = torch.full((b, pad_to), IGNORE, dtype=torch.long)
        # "padded": pads continue the row's positions (what the model does without position_ids);
        # "packed": the pad tail is a sequence of its own starting at 0, which no document attends to
        position_ids = torch.arange(pad_to, dtype=torch.long).repeat(b, 1)
        mask = torch.zeros((b, pad_to), dtype=torch.long)
        for i, ex in enumerate(examples):
            n = len(ex.input_ids)
            input_ids[i, :n] = torch.tensor(ex.input_ids)
            labels[i, :n] = torch.tensor(ex.labels)
            position_ids[i, :n] = torch.tensor(ex.position_ids)
            if layout == "packed":
                position_ids[i, n:] -= n
            mask[i, :n] = 1
    labels[position_ids == 0] = IGNORE
    out = {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}
    if layout == "padded":
        # no mask otherwise: transformers detects packed sequences only when attention_mask is None
        out["attention_mask"] = mask
    return out


def pack(examples: Sequence[Example], block: int) -> list[Example]:
    """Concatenate `examples` and cut them into `block`-token blocks (TRL's "wrapped" packing).

    A document that does not fit continues in the next block as a new sequence (positions restart at 0),
    so no tokens are cut away; only the last, partial block is left out.
    """
    ids: list[int] = []
    labels: list[int] = []
    pos: list[int] = []
    for ex in examples:
        ids.extend(ex.input_ids)
        labels.extend(ex.labels)
        pos.extend(ex.position_ids)
    blocks = []
    for k in range(0, len(ids) - block + 1, block):
        p = pos[k : k + block]
        # the piece of a document carried over from the previous block starts a new sequence here
        carried = next((j for j, v in enumerate(p) if v == 0), len(p))
        p = list(range(carried)) + p[carried:]
        lab = [IGNORE if q == 0 else t for t, q in zip(labels[k : k + block], p, strict=True)]
        blocks.append(Example(ids[k : k + block], lab, p))
    return blocks


class ShardedBatches:
    """This rank's micro-batches, addressed by (global step, accumulation index): resumable anywhere.

    Without packing, rank r's micro-batch k of epoch e is rows order_e[r::N][k*B:(k+1)*B]; the global
    micro-batch across ranks is order_e[N*k*B : N*(k+1)*B], exactly what one rank with batch N*B takes.
    With packing, each rank concatenates its shard's rows into max_length blocks; ranks then must agree on
    the smallest step count (the caller sets `steps_per_epoch`), and world-size equivalence no longer holds (blocks differ).
    """

    def __init__(
        self,
        rows: list[dict],
        tokenizer: Any,
        *,
        max_length: int,
        batch_size: int,
        grad_accum: int,
        seed: int,
        rank: int,
        world_size: int,
        packing: bool = False,
        padding_free: bool = False,
        attn_implementation: str | None = None,
    ):
        self.rows = rows
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.batch_size = batch_size
        self.grad_accum = grad_accum
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.packing = packing
        self.padding_free = padding_free
        self.pad_id = tokenizer.pad_token_id
        # flash attention finds sequence starts from position_ids only in a one-row batch: packed blocks
        # go side by side there; SDPA and eager get a block-diagonal mask per row, so rows stay rows
        flash = "flash" in (attn_implementation or "")
        self.layout = (
            "flat" if padding_free or (packing and flash) else "packed" if packing else "padded"
        )
        if self.layout != "padded":
            check_packed_attention()
        self._cache: dict[int, Example] = {}
        self._blocks: tuple[int, list[Example]] | None = None
        rows_per_rank = len(rows) // world_size
        if packing:
            # ranks' counts differ; the caller sets the agreed minimum across ranks
            self.steps_per_epoch = len(self._packed(0)) // batch_size // grad_accum
        else:
            self.steps_per_epoch = rows_per_rank // batch_size // grad_accum
        if self.steps_per_epoch < 1:
            need = world_size * batch_size * grad_accum
            what = "max_length blocks after packing" if packing else "rows"
            msg = (
                f"data has too few {what} for one optimizer step: a step takes {need} "
                f"({world_size} ranks x per_device_train_batch_size {batch_size} x "
                f"gradient_accumulation_steps {grad_accum}) and there are {len(rows)} rows; add rows or "
                "lower the batch size or accumulation steps"
            )
            raise ConfigError(msg)

    def example(self, index: int) -> Example:
        ex = self._cache.get(index)
        if ex is None:
            # packed rows are not cut at max_length: what does not fit continues in the next block
            length = None if self.packing else self.max_length
            ex = self._cache[index] = encode_row(self.rows[index], self.tokenizer, length)
        return ex

    def collate(self, examples: Sequence[Example], pad_to: int) -> dict[str, Any]:
        """`examples` as model inputs in this run's layout (`pad_to` is ignored by padding-free)."""
        return collate(examples, pad_to, self.pad_id, self.layout)

    def shard(self, epoch: int) -> list[int]:
        """Row indices this rank takes in `epoch`, in order."""
        return epoch_order(len(self.rows), self.seed, epoch)[self.rank :: self.world_size]

    def _packed(self, epoch: int) -> list[Example]:
        if self._blocks is not None and self._blocks[0] == epoch:
            return self._blocks[1]
        blocks = pack([self.example(i) for i in self.shard(epoch)], self.max_length)
        self._blocks = (epoch, blocks)
        return blocks

    def micro_batch(self, step: int, accum: int) -> list[Example]:
        """The examples this rank trains on in micro-batch `accum` of global step `step` (0-based)."""
        epoch, in_epoch = divmod(step, self.steps_per_epoch)
        k = in_epoch * self.grad_accum + accum
        B = self.batch_size
        if self.packing:
            blocks = self._packed(epoch)
            # a later epoch may pack into fewer blocks than epoch 0 set the step count by: wrap around
            return [blocks[j % len(blocks)] for j in range(k * B, (k + 1) * B)]
        return [self.example(i) for i in self.shard(epoch)[k * B : (k + 1) * B]]


def eval_batches(
    rows: list[dict],
    tokenizer: Any,
    *,
    max_length: int,
    batch_size: int,
    rank: int,
    world_size: int,
) -> list[list[Example]]:
    """This rank's evaluation batches: rows r, r+N, ... in file order, none dropped."""
    mine = [encode_row(rows[i], tokenizer, max_length) for i in range(rank, len(rows), world_size)]
    return [mine[k : k + batch_size] for k in range(0, len(mine), batch_size)]
