"""Preference rows (DPO): TRL's formats, checks, tokenization as TRL's DPOTrainer does it, and batches.

Rows come in TRL's preference formats:
- ``prompt``/``chosen``/``rejected``, standard (strings) or conversational (lists of messages);
- ``chosen``/``rejected`` only (implicit prompt): the prompt is their longest common prefix, cut as
  TRL's `extract_prompt` cuts it (characters of a string, whole messages of a conversation).

Tokenization follows TRL 1.x's `DPOTrainer._prepare_dataset`: a standard row's completions get the eos
token's text appended (unless they end with it), then the prompt, prompt + chosen and prompt + rejected
are tokenized alone; a conversational row renders the prompt with the generation prompt, and prompt +
chosen and prompt + rejected without it. The completion starts where the tokenized prompt and the
tokenized prompt + completion first differ, so a token that straddles the boundary is the completion's.

A pair is one row of the token cache (`nbtrain.data.tokens.prepare` with this module as its encoder):
its prompt, chosen and rejected tokens end to end, with "trained" 0, 1 and 2 marking which is which.
So pairs are tokenized once per cluster, checked (bad rows named by file, line and index before any
step) and read memory-mapped, as SFT rows are. Truncation is applied per batch, as TRL's collator does:
each of prompt + chosen and prompt + rejected is cut to `max_length` at `truncation_side`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from nbtrain.data.chat import check_template
from nbtrain.data.loader import ShardedBatches
from nbtrain.errors import ConfigError

log = logging.getLogger(__name__)

#: what the no-rows message asks for (tokens.prepare)
ACCEPTED = (
    "'prompt' + 'chosen' + 'rejected' (strings or lists of messages), or 'chosen' + 'rejected'"
)
PROMPT, CHOSEN, REJECTED = 0, 1, 2


# ----------------------------------------------------------------------------------------- formats
def _is_messages(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in value)
    )


def pref_format(row: Any) -> str:
    """ "standard" or "conversational"; a ConfigError saying what is wrong with the row otherwise."""
    if not isinstance(row, dict):
        msg = f"the row is a {type(row).__name__}, not a dict; each row needs {ACCEPTED}"
        raise ConfigError(msg)
    if "chosen" not in row or "rejected" not in row:
        keys = ", ".join(repr(k) for k in row) or "none"
        msg = (
            f"the row is not a preference pair: keys found {keys}; each row needs {ACCEPTED} "
            "(SFT rows go to nbtrain.SFTConfig)"
        )
        raise ConfigError(msg)
    values = {k: row[k] for k in ("prompt", "chosen", "rejected") if k in row}
    if all(isinstance(v, str) for v in values.values()):
        return "standard"
    if all(_is_messages(v) for v in values.values()):
        return "conversational"
    kinds = ", ".join(f"{k} is a {type(v).__name__}" for k, v in values.items())
    msg = (
        f"{', '.join(values)} must all be strings or all be non-empty lists of {{'role', "
        f"'content'}} messages ({kinds})"
    )
    raise ConfigError(msg)


def extract_prompt(chosen: Any, rejected: Any) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected) of an implicit-prompt pair: the longest common prefix is the prompt,
    exactly as TRL's `extract_prompt` cuts it (a space before the split goes to the completions)."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):  # noqa: B007 (TRL's loop, kept as it is)
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# ------------------------------------------------------------------------------------ tokenization
def _triple(row: dict) -> tuple[str, Any, Any, Any]:
    """(format, prompt, chosen, rejected) of a row, the prompt extracted where it is implicit."""
    fmt = pref_format(row)
    if row["chosen"] == row["rejected"]:
        msg = (
            "'chosen' and 'rejected' are the same, so the pair prefers nothing; fix or drop the row"
        )
        raise ConfigError(msg)
    if "prompt" in row:
        return fmt, row["prompt"], row["chosen"], row["rejected"]
    return (fmt, *extract_prompt(row["chosen"], row["rejected"]))


def _render_ids(tokenizer: Any, messages: list, generation: bool, tools: Any, kw: dict) -> list:
    try:
        out = tokenizer.apply_chat_template(
            messages,
            tokenize=True,
            return_dict=True,
            add_generation_prompt=generation,
            tools=tools,
            **kw,
        )
    except Exception as e:  # a template's raise_exception(...), a role it does not know
        msg = (
            f"the chat template could not render it ({type(e).__name__}: {e}); change the "
            "messages to what the template accepts, or give the row as strings"
        )
        raise ConfigError(msg) from None
    return list(out["input_ids"])


def _split(p: list, pc: list, pr: list) -> tuple[list, list, list]:
    """TRL's split: the completion starts where prompt and prompt + completion diverge."""
    n = min(_common(p, pc), _common(p, pr))
    chosen, rejected = pc[n:], pr[n:]
    if not chosen or not rejected:
        which = "chosen" if not chosen else "rejected"
        msg = f"the {which} completion has no tokens after the prompt; give it content"
        raise ConfigError(msg)
    return p[:n], chosen, rejected


def _arrays(p: list, c: list, r: list) -> tuple[Any, Any]:
    import numpy as np

    ids = np.asarray(p + c + r, dtype=np.int32)
    which = np.repeat(
        np.asarray([PROMPT, CHOSEN, REJECTED], dtype=np.uint8), [len(p), len(c), len(r)]
    )
    return ids, which


def alike(row: Any) -> str | None:
    """What to say when every row of the data is refused as `row` is, where its keys are why ("all
    40 rows have keys 'prompt', 'completion'; preference rows need ..."); None for any other fault."""
    if not isinstance(row, dict) or ("chosen" in row and "rejected" in row):
        return None
    keys = ", ".join(repr(k) for k in row) or "none"
    return f"have keys {keys}; preference rows need {ACCEPTED} (SFT rows go to nbtrain.SFTConfig)"


def encode_batch(
    rows: Sequence[Any], tokenizer: Any, template_kwargs: dict | None = None
) -> list[Any]:
    """Each pair as (ids int32, which uint8: 0 prompt, 1 chosen, 2 rejected), or the ConfigError that
    refuses it: the encoder `tokens.prepare` takes for preference data."""
    out: list[Any] = [None] * len(rows)
    standard: list[tuple[int, str, str, str]] = []
    eos = tokenizer.eos_token
    for j, row in enumerate(rows):
        try:
            fmt, prompt, chosen, rejected = _triple(row)
            if fmt == "standard":
                # TRL appends the eos token's text to each completion that does not end with it
                if eos is not None:
                    chosen = chosen if chosen.endswith(eos) else chosen + eos
                    rejected = rejected if rejected.endswith(eos) else rejected + eos
                standard.append((j, prompt, prompt + chosen, prompt + rejected))
                continue
            check_template(tokenizer)
            tools, kwargs = row.get("tools"), row.get("chat_template_kwargs")
            if isinstance(tools, str):
                tools = json.loads(tools)
            kw = {**(template_kwargs or {}), **(kwargs or {})}
            p = _render_ids(tokenizer, prompt, True, tools, kw)
            pc = _render_ids(tokenizer, prompt + chosen, False, tools, kw)
            pr = _render_ids(tokenizer, prompt + rejected, False, tools, kw)
            out[j] = _arrays(*_split(p, pc, pr))
        except ConfigError as e:
            out[j] = e
        except json.JSONDecodeError as e:
            out[j] = ConfigError(f"'tools' is a string that is not JSON ({e})")
    if standard:
        # one batched call per text kind: a fast tokenizer encodes a list in parallel
        texts = [[s[k] for s in standard] for k in (1, 2, 3)]
        p_ids, c_ids, r_ids = (tokenizer(t)["input_ids"] for t in texts)
        for (j, *_), p, pc, pr in zip(standard, p_ids, c_ids, r_ids, strict=True):
            try:
                out[j] = _arrays(*_split(list(p), list(pc), list(pr)))
            except ConfigError as e:
                out[j] = e
    return out


def row_problem(
    row: Any, tokenizer: Any, index: int, where: str, template_kwargs: dict | None = None
) -> str:
    """Why `row` is refused, naming `where` (file and line) and its index."""
    res = encode_batch([row], tokenizer, template_kwargs)[0]
    text = str(res) if isinstance(res, ConfigError) else "refused"
    return f"{where} row {index}: {text}"


def encode_pairs(rows: Sequence[dict], tokenizer: Any, template_kwargs: dict | None = None) -> Any:
    """Rows held in memory as an in-memory token store of pairs (tests, small data); the first bad
    row is a ConfigError."""
    from nbtrain.data.store import PartWriter

    w = PartWriter(None)
    for j, res in enumerate(encode_batch(rows, tokenizer, template_kwargs)):
        if isinstance(res, ConfigError):
            raise ConfigError(row_problem(rows[j], tokenizer, j, "data", template_kwargs))
        w.add(*res)
    return w.store()


# ---------------------------------------------------------------------------------------- batches
@dataclass
class Pair:
    """One tokenized preference pair, and its row in the data (for precomputed reference log-probs)."""

    index: int
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


def load_pairs(
    source: Any, name: str, tokenizer: Any, template_kwargs: dict | None = None
) -> list[Pair]:
    """Every row of a small data set (eval_data) as a Pair, held in memory; its bad rows (the first
    20) refused together in one ConfigError naming each one's file, line and index."""
    from nbtrain.data.sources import Source

    src = Source(source, name)
    rows = list(src.part(0, 1))
    results = encode_batch([r.value for r in rows], tokenizer, template_kwargs)
    bad = [
        row_problem(r.value, tokenizer, i, src.row_where(r), template_kwargs)
        for i, (r, res) in enumerate(zip(rows, results, strict=True))
        if isinstance(res, ConfigError)
    ]
    if bad:
        msg = f"{src.where}: {len(bad)} of {len(rows)} rows are refused; fix or remove them:\n"
        raise ConfigError(msg + "\n".join(bad[:20]))
    if not rows:
        msg = f"{src.where} has no rows; give at least one row with {ACCEPTED}"
        raise ConfigError(msg)
    pairs = []
    for i, (ids, which) in enumerate(results):
        pairs.append(
            Pair(
                i,
                ids[which == PROMPT].tolist(),
                ids[which == CHOSEN].tolist(),
                ids[which == REJECTED].tolist(),
            )
        )
    return pairs


@dataclass
class Cut:
    """How a pair's sequences are cut, as TRL's collator does (and the older TRL's length limits)."""

    max_length: int | None
    side: str = "right"  # "right": TRL's keep_start; "left": keep_end
    max_prompt_length: int | None = None
    max_completion_length: int | None = None

    def seqs(self, pair: Pair) -> list[tuple[list[int], list[int]]]:
        """(ids, completion mask) of prompt + chosen and of prompt + rejected."""
        p = pair.prompt
        if self.max_prompt_length is not None:
            p = p[-self.max_prompt_length :] if len(p) > self.max_prompt_length else p
        out = []
        for c in (pair.chosen, pair.rejected):
            if self.max_completion_length is not None:
                c = c[: self.max_completion_length]
            ids, mask = p + c, [0] * len(p) + [1] * len(c)
            if self.max_length is not None and len(ids) > self.max_length:
                keep = (
                    slice(None, self.max_length)
                    if self.side == "right"
                    else slice(-self.max_length, None)
                )
                ids, mask = ids[keep], mask[keep]
            out.append((ids, mask))
        return out

    def length(self, pair: Pair) -> int:
        return max(len(ids) for ids, _ in self.seqs(pair))

    def keeps(self, pair: Pair) -> bool:
        """Whether TRL keeps the pair: not where its prompt alone fills max_length (keep_start)."""
        if self.max_length is None or self.side != "right":
            return True
        return int(self.prompt_length(len(pair.prompt))) < self.max_length

    def prompt_length(self, n: Any) -> Any:
        """A prompt of `n` tokens (an int, or an array of them) after max_prompt_length."""
        if self.max_prompt_length is None:
            return n
        return (
            n.clip(max=self.max_prompt_length)
            if hasattr(n, "clip")
            else min(n, self.max_prompt_length)
        )


def collate(pairs: Sequence[Pair], pad_to: int, pad_id: int, cut: Cut) -> dict[str, Any]:
    """A micro-batch as TRL's DPO collator lays it out: rows 0..B-1 prompt + chosen, rows B..2B-1
    prompt + rejected, right-padded to `pad_to` (the longest in the global micro-batch), with the
    attention mask, the completion mask, `real` (False for the stand-in pair of a rank with no rows
    left) and the rows' indices."""
    import torch

    real = [True] * len(pairs)
    if not pairs:
        # no pairs left for this rank in an epoch's last step: one pair of pad tokens keeps it in the
        # step's collectives, and counts for nothing
        pairs, real = [Pair(-1, [pad_id], [pad_id], [pad_id])], [False]
    seqs = [cut.seqs(p) for p in pairs]
    ordered = [s[0] for s in seqs] + [s[1] for s in seqs]
    width = max(pad_to, max(len(ids) for ids, _ in ordered))
    n = len(ordered)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    completion = torch.zeros((n, width), dtype=torch.long)
    for i, (ids, mask) in enumerate(ordered):
        input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention[i, : len(ids)] = 1
        completion[i, : len(ids)] = torch.tensor(mask, dtype=torch.long)
    if not real[0]:
        completion.zero_()
    return {
        "input_ids": input_ids,
        "attention_mask": attention,
        "completion_mask": completion,
        "real": torch.tensor(real, dtype=torch.bool),
        "index": torch.tensor([p.index for p in pairs], dtype=torch.long),
    }


class _PairStore:
    """A token store of pairs, as `ShardedBatches` asks it which rows to keep: a pair is kept unless
    its prompt alone fills max_length with truncation_side 'right' (TRL drops those: nothing of the
    completions would be left)."""

    def __init__(self, store: Any, cut: Cut) -> None:
        self.store, self.cut = store, cut

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def __len__(self) -> int:
        return len(self.store)

    def has_target(self, max_length: int | None, side: str) -> Any:
        # the first nonzero "which" at position >= 1 is where the chosen completion starts
        has = self.store.first >= 0
        if max_length is None or side != "right":
            return has
        return has & (self.cut.prompt_length(self.store.first) < max_length)


class PrefBatches(ShardedBatches):
    """This rank's micro-batches of pairs, addressed by (global step, accumulation index): the same
    global order, sharding and resume arithmetic as SFT's rows (`ShardedBatches`), a unit being a pair."""

    def __init__(self, store: Any, tokenizer: Any, cut: Cut, **kwargs: Any) -> None:
        self.cut = cut
        super().__init__(
            None,
            tokenizer,
            store=cast(Any, _PairStore(store, cut)),
            max_length=cut.max_length or 2**31,
            truncation_side=cut.side,
            **kwargs,
        )

    def _report(self, has: Any, side: str) -> None:
        import numpy as np

        dropped = np.flatnonzero(~has)
        if len(dropped):
            shown = ", ".join(map(str, dropped[:10].tolist())) + (
                ", ..." if len(dropped) > 10 else ""
            )
            print(
                f"nbtrain: {len(dropped)} of {len(has)} pairs have a prompt of max_length="
                f"{self.max_length} tokens or more and are skipped, as TRL skips them (rows "
                f"{shown}); raise max_length or set max_prompt_length",
                flush=True,
            )

    def example(self, index: int) -> Pair:  # type: ignore[override]
        import numpy as np

        ids, which = self.store.arrays(index)
        ids, which = np.asarray(ids), np.asarray(which)
        return Pair(
            index,
            ids[which == PROMPT].tolist(),
            ids[which == CHOSEN].tolist(),
            ids[which == REJECTED].tolist(),
        )

    def length(self, pair: Pair) -> int:
        """The longer of the pair's two sequences, as cut."""
        return self.cut.length(pair)

    def collate(self, examples: Sequence[Any], pad_to: int) -> dict[str, Any]:
        return collate(examples, pad_to, self.pad_id, self.cut)
