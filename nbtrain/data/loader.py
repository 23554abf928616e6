"""Batches: the epoch order, sharding across ranks, packing, and collation into model inputs.

Sharding: one global order per epoch, shuffled from ``seed``; rank r takes positions r, r+N, r+2N...
Micro-batch k of rank r then holds global positions N*k*B ... N*(k+1)*B-1 across ranks, the same rows one
rank with batch N*B sees, which is what makes N ranks equal one. With packing the positions are those of
max_length blocks cut from the epoch's rows laid end to end, so the same holds for packed runs.

Every row is used every epoch: the last step of an epoch takes what is left (HF Trainer's default), and a
rank with nothing left trains on a single pad token with no target, so it still joins the step's
all-reduce. Rows with no target token (a prompt longer than max_length) are dropped, with a count.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

# rows.py holds the rows and their tokenization; its names are also importable from here
from nbtrain.data.rows import (
    FORMATS,
    IGNORE,
    TRUNCATION_SIDES,
    Example,
    encode_row,
    encode_rows,
    load_rows,
    row_format,
)
from nbtrain.data.store import TokenStore
from nbtrain.errors import ConfigError

log = logging.getLogger(__name__)

__all__ = [
    "FORMATS",
    "IGNORE",
    "LAYOUTS",
    "TRUNCATION_SIDES",
    "Example",
    "ShardedBatches",
    "check_packed_attention",
    "collate",
    "encode_row",
    "encode_rows",
    "epoch_order",
    "eval_batches",
    "load_rows",
    "pack",
    "row_format",
]


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
    if not examples:
        # this rank has no rows left in an epoch's last step: one pad token with no target keeps it
        # in the step (DDP all-reduces gradients on every rank), and adds nothing to the loss
        examples = [Example([pad_id], [IGNORE])]
        pad_to = max(pad_to, 1)
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


def _cut(pieces: Any, ends: Any, lo: int, hi: int) -> Example:
    """Tokens lo..hi-1 of `pieces` laid end to end (`ends`: their cumulative lengths) as one block.

    A piece that started in an earlier block starts over here as a new sequence (positions from 0), so
    the model never attends across a block boundary or across two documents.
    """
    import numpy as np

    ids: list[int] = []
    labels: list[int] = []
    pos: list[int] = []
    r = int(np.searchsorted(ends, lo, side="right"))
    while r < len(pieces) and (int(ends[r - 1]) if r else 0) < hi:
        begin = int(ends[r - 1]) if r else 0
        a, b = max(lo, begin) - begin, min(hi, int(ends[r])) - begin
        ex = pieces[r]
        ids.extend(ex.input_ids[a:b])
        labels.extend(ex.labels[a:b])
        pos.extend(range(b - a))
        r += 1
    labels = [IGNORE if p == 0 else t for t, p in zip(labels, pos, strict=True)]
    return Example(ids, labels, pos)


def _ends(pieces: Any) -> Any:
    """Where each piece ends when they are laid end to end: from Examples, or an array of lengths."""
    import numpy as np

    if len(pieces) and isinstance(pieces[0], Example):
        pieces = [len(e.input_ids) for e in pieces]
    return np.cumsum(pieces, dtype=np.int64)


def pack(examples: Sequence[Example], block: int) -> list[Example]:
    """Lay `examples` end to end and cut them into `block`-token blocks (TRL's "wrapped" packing).

    A document that does not fit continues in the next block as a new sequence (positions restart at
    0); nothing is cut away, and the last block holds what is left (it may be shorter).
    """
    ends = _ends(examples)
    total = int(ends[-1]) if len(ends) else 0
    return [_cut(examples, ends, k, min(k + block, total)) for k in range(0, total, block)]


class ShardedBatches:
    """This rank's micro-batches, addressed by (global step, accumulation index): resumable anywhere.

    Rank r's micro-batch k of epoch e is units order_e[r::N][k*B:(k+1)*B], a unit being a row, or with
    packing a max_length block of the epoch's rows laid end to end; the global micro-batch across ranks
    is units N*k*B ... N*(k+1)*B-1, exactly what one rank with batch N*B takes.

    The rows come tokenized in a `TokenStore` (memory-mapped from the token cache in `finetune`; made
    here from `rows` when given a list): every rank addresses every row, since each epoch is a fresh
    global shuffle, but only the rows a micro-batch takes are read, when it takes them. What decides the
    plan (row lengths, where each row's trained tokens are) is a few numbers per row, so packed blocks
    and the rows dropped for having no target come out the same on every rank without a collective.
    """

    def __init__(
        self,
        rows: list[dict] | None,
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
        truncation_side: str = "right",
        store: TokenStore | None = None,
    ):
        import numpy as np

        self.rows = rows
        self.store = (
            store if store is not None else TokenStore.from_rows(list(rows or []), tokenizer)
        )
        self.max_length = max_length
        self.truncation_side = truncation_side
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
        # packed rows are not cut at max_length: what does not fit continues in the next block
        self.cut_at = None if packing else max_length
        has = self.store.has_target(self.cut_at, truncation_side)
        self.kept = np.flatnonzero(has).tolist()
        if rank == 0:
            self._report(has, truncation_side)
        n = len(self.store)
        if not self.kept:
            msg = (
                f"none of the {n} rows has a target token within max_length={max_length} "
                "(each prompt fills it); raise max_length or shorten the prompts"
            )
            raise ConfigError(msg)
        self._order: tuple[int, list[int]] | None = None
        self._stream: tuple[int, Any, Any] | None = None
        if packing:
            self.n_units = -(-int(self.store.lengths[self.kept].sum()) // max_length)
        else:
            self.n_units = len(self.kept)
        need = world_size * batch_size * grad_accum
        if self.n_units < need:
            what = "max_length blocks after packing" if packing else "rows"
            msg = (
                f"data has too few {what} for one optimizer step: a step takes {need} "
                f"({world_size} ranks x per_device_train_batch_size {batch_size} x "
                f"gradient_accumulation_steps {grad_accum}) and there are {self.n_units}; add rows or "
                "lower the batch size or accumulation steps"
            )
            raise ConfigError(msg)
        # the last step of an epoch takes the rows that are left
        self.steps_per_epoch = -(-self.n_units // need)

    def _report(self, has: Any, side: str) -> None:
        import numpy as np

        n = len(self.store)
        if self.cut_at is not None:
            truncated = int((self.store.lengths > self.cut_at).sum())
            if truncated:
                lost = "end, eos included" if side == "right" else "beginning"
                print(
                    f"nbtrain: {truncated} of {n} rows are longer than max_length={self.max_length} "
                    f"tokens and are cut at the {side} (they lose their {lost}); raise max_length, "
                    "set truncation_side, or packing=True to keep every token",
                    flush=True,
                )
        dropped = np.flatnonzero(~has)
        if len(dropped):
            shown = ", ".join(map(str, dropped[:10].tolist())) + (
                ", ..." if len(dropped) > 10 else ""
            )
            print(
                f"nbtrain: {len(dropped)} of {n} rows have no target token within "
                f"max_length={self.max_length} and are skipped (rows {shown}); raise max_length, "
                "shorten their prompts, or set truncation_side='left'",
                flush=True,
            )

    def example(self, index: int) -> Example:
        """Row `index` of the data, tokenized (and cut at max_length, without packing)."""
        return self.store.example(index, self.cut_at, self.truncation_side)

    def collate(self, examples: Sequence[Example], pad_to: int) -> dict[str, Any]:
        """`examples` as model inputs in this run's layout (`pad_to` is ignored by padding-free)."""
        return collate(examples, pad_to, self.pad_id, self.layout)

    def order(self, epoch: int) -> list[int]:
        """The kept rows in `epoch`'s global order (row indices into the data)."""
        if self._order is None or self._order[0] != epoch:
            perm = epoch_order(len(self.kept), self.seed, epoch)
            self._order = (epoch, [self.kept[j] for j in perm])
        return self._order[1]

    def shard(self, epoch: int) -> list[int]:
        """Row indices this rank takes in `epoch`, in order (without packing)."""
        return self.order(epoch)[self.rank :: self.world_size]

    def _block(self, epoch: int, j: int) -> Example:
        import numpy as np

        if self._stream is None or self._stream[0] != epoch:
            order = np.asarray(self.order(epoch), dtype=np.int64)
            self._stream = (epoch, order, _ends(self.store.lengths[order]))
        _, order, ends = self._stream
        L = self.max_length
        return _cut(_Rows(self.store, order), ends, j * L, min((j + 1) * L, int(ends[-1])))

    def _packed(self, epoch: int) -> list[Example]:
        """Every block of `epoch`, in order (all ranks' blocks)."""
        return [self._block(epoch, j) for j in range(self.n_units)]

    def consumed(self, steps: int) -> int:
        """Units (rows, or max_length blocks with packing) all ranks together took in the first `steps`
        steps: an epoch's short last step counts only the units it had."""
        need = self.world_size * self.batch_size * self.grad_accum
        epochs, in_epoch = divmod(steps, self.steps_per_epoch)
        return epochs * self.n_units + min(in_epoch * need, self.n_units)

    def micro_batch(self, step: int, accum: int) -> list[Example]:
        """The examples this rank trains on in micro-batch `accum` of global step `step` (0-based).

        Empty when the epoch's last step has nothing left for this rank.
        """
        epoch, in_epoch = divmod(step, self.steps_per_epoch)
        k = in_epoch * self.grad_accum + accum
        B = self.batch_size
        units = range(self.rank, self.n_units, self.world_size)[k * B : (k + 1) * B]
        if self.packing:
            return [self._block(epoch, j) for j in units]
        order = self.order(epoch)
        return [self.example(order[j]) for j in units]


class _Rows:
    """Rows of a store in an epoch's order, read one at a time as `_cut` takes them."""

    def __init__(self, store: TokenStore, order: Any) -> None:
        self.store, self.order = store, order

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, r: int) -> Example:
        return self.store.example(int(self.order[r]))


def eval_batches(
    rows: list[dict],
    tokenizer: Any,
    *,
    max_length: int,
    batch_size: int,
    rank: int,
    world_size: int,
    truncation_side: str = "right",
    truncated: list[int] | None = None,
    template_kwargs: dict | None = None,
) -> list[list[Example]]:
    """This rank's evaluation batches: rows r, r+N, ... in file order, none dropped; the rows cut at
    `max_length` are added to `truncated` where given."""
    indices = list(range(rank, len(rows), world_size))
    mine, cut_rows = encode_rows(
        [rows[i] for i in indices],
        tokenizer,
        max_length,
        truncation_side=truncation_side,
        where="eval_data",
        indices=indices,
        template_kwargs=template_kwargs,
    )
    if truncated is not None:
        truncated.extend(cut_rows)
    return [mine[k : k + batch_size] for k in range(0, len(mine), batch_size)]
