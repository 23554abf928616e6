"""The token cache's files, and the store every rank reads rows from.

Per token the cache holds the id (int32) and whether it is trained (uint8): 5 bytes a token, plus 24
bytes a row (where the row ends, and where its first and last trained tokens are). numpy files and
`np.memmap` rather than Arrow through `datasets`: a row's tokens are one contiguous slice, no per-row
objects or list columns (Arrow stores each list with 64-bit ids and offsets), and the pages a rank
reads are shared with every other rank on the node by the page cache. `meta.json` is written last:
a folder without it, with a part of the wrong size, or of another format or nbtrain version is no cache.
"""

from __future__ import annotations

import json
import logging
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nbtrain.data.rows import IGNORE, Example, cut, encode_batch, row_problem
from nbtrain.errors import ConfigError

log = logging.getLogger(__name__)

#: the cache's layout; bump it when the files or the tokenization's meaning change
FORMAT = 1
META = "meta.json"
#: rows tokenized per batch: the tokenizer's call and the file writes work on this many at once
CHUNK = 1000


def version() -> str:
    """nbtrain's version, which a cache must have been written by."""
    from nbtrain.version import __version__

    return str(__version__)


# ------------------------------------------------------------------------------------------ the store
@dataclass
class _Part:
    ids: Any  # int32, every token of the part
    trained: Any  # uint8, 1 where the token carries loss
    ends: Any  # int64, where each row's tokens end in `ids`


class TokenStore:
    """Tokenized rows: row i's ids and trained flags, with each row's length and where its first and
    last trained token (at position 1 or later) sit, for truncation and packing without reading rows.
    """

    def __init__(self, parts: list[_Part], first: Any, last: Any, location: str | None = None):
        import numpy as np

        self.parts = parts
        counts = [len(p.ends) for p in parts]
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        lengths = [np.diff(np.concatenate([[0], p.ends])) for p in parts]
        self.lengths = (
            np.concatenate(lengths).astype(np.int64) if lengths else np.zeros(0, np.int64)
        )
        self.first = first
        self.last = last
        self.location = location

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def n_tokens(self) -> int:
        return int(self.lengths.sum())

    def arrays(self, i: int) -> tuple[Any, Any]:
        """Row i's (input_ids, trained) as arrays (memory-mapped slices for a cached store)."""
        import numpy as np

        p = int(np.searchsorted(self.starts, i, side="right")) - 1
        part, j = self.parts[p], i - int(self.starts[p])
        a = int(part.ends[j - 1]) if j else 0
        b = int(part.ends[j])
        return part.ids[a:b], part.trained[a:b]

    def example(self, i: int, max_length: int | None = None, side: str = "right") -> Example:
        import numpy as np

        ids, trained, _ = cut(*self.arrays(i), max_length, side)
        ids = np.asarray(ids)
        return Example(ids.tolist(), np.where(trained.astype(bool), ids, IGNORE).tolist())

    def has_target(self, max_length: int | None, side: str) -> Any:
        """Per row: whether a trained token at position >= 1 survives the cut to `max_length`."""

        has = self.first >= 0
        if max_length is None:
            return has
        long = self.lengths > max_length
        if side == "right":
            return has & (~long | (self.first < max_length))
        # cut at the left: the kept window's first token is position 0 and is never a target
        return has & (~long | (self.last > self.lengths - max_length))

    @classmethod
    def from_rows(
        cls,
        rows: list[Any],
        tokenizer: Any,
        where: str = "data",
        template_kwargs: dict | None = None,
    ) -> TokenStore:
        """Rows held in memory, tokenized here (tests; small data); the first bad row is an error."""
        w = PartWriter(None)
        for start in range(0, len(rows), CHUNK):
            chunk = rows[start : start + CHUNK]
            for j, res in enumerate(encode_batch(chunk, tokenizer, template_kwargs)):
                if isinstance(res, ConfigError):
                    msg = row_problem(chunk[j], tokenizer, start + j, where, template_kwargs)
                    raise ConfigError(msg)
                w.add(*res)
        return w.store()


class PartWriter:
    """A part's tokens, streamed to files under `stem` (or kept in memory when `stem` is None)."""

    def __init__(self, stem: Path | None) -> None:
        self.stem = stem
        self.ends = array("q")
        self.first = array("l")
        self.last = array("l")
        self.n = 0
        self.chunks: list[tuple[Any, Any]] = []
        self.files = (
            (open(f"{stem}.ids", "wb"), open(f"{stem}.trained", "wb")) if stem else None  # noqa: SIM115
        )

    def add(self, ids: Any, trained: Any) -> None:
        import numpy as np

        self.n += len(ids)
        self.ends.append(self.n)
        # targets sit at position 1 or later: a sequence's first token is never predicted
        hits = np.flatnonzero(trained[1:])
        self.first.append(int(hits[0]) + 1 if len(hits) else -1)
        self.last.append(int(hits[-1]) + 1 if len(hits) else -1)
        if self.files:
            self.files[0].write(np.ascontiguousarray(ids, dtype=np.int32).tobytes())
            self.files[1].write(np.ascontiguousarray(trained, dtype=np.uint8).tobytes())
        else:
            self.chunks.append((ids, trained))

    def close(self) -> dict[str, int]:
        import numpy as np

        if self.files:
            for f in self.files:
                f.close()
            rows = np.stack(
                [
                    np.frombuffer(self.ends, dtype=np.int64),
                    np.asarray(self.first, dtype=np.int64),
                    np.asarray(self.last, dtype=np.int64),
                ],
                axis=1,
            )
            np.save(f"{self.stem}.rows.npy", rows)
        return {"rows": len(self.ends), "tokens": self.n}

    def store(self) -> TokenStore:
        """The rows added, as an in-memory store (a writer made with no files)."""
        import numpy as np

        ids = np.concatenate([c[0] for c in self.chunks]) if self.chunks else np.zeros(0, np.int32)
        trained = (
            np.concatenate([c[1] for c in self.chunks]) if self.chunks else np.zeros(0, np.uint8)
        )
        part = _Part(ids.astype(np.int32), trained.astype(np.uint8), np.asarray(self.ends))
        return TokenStore(
            [part], np.asarray(self.first, np.int64), np.asarray(self.last, np.int64), None
        )


def part_stem(folder: Path, k: int) -> Path:
    return folder / f"part-{k:05d}"


def open_cache(folder: Path) -> TokenStore | None:
    """The cache in `folder`, memory-mapped; None when it is missing, incomplete or another version's."""
    import numpy as np

    try:
        meta = json.loads((folder / META).read_text())
    except (OSError, ValueError):
        return None
    if meta.get("format") != FORMAT or meta.get("nbtrain") != version():
        return None
    parts, firsts, lasts = [], [], []
    try:
        for k, info in enumerate(meta["parts"]):
            stem = part_stem(folder, k)
            n, rows = int(info["tokens"]), int(info["rows"])
            ids_f, tr_f = Path(f"{stem}.ids"), Path(f"{stem}.trained")
            if ids_f.stat().st_size != 4 * n or tr_f.stat().st_size != n:
                return None
            table = np.load(f"{stem}.rows.npy", mmap_mode="r")
            if table.shape != (rows, 3):
                return None
            ids = np.memmap(ids_f, dtype=np.int32, mode="r") if n else np.zeros(0, np.int32)
            tr = np.memmap(tr_f, dtype=np.uint8, mode="r") if n else np.zeros(0, np.uint8)
            parts.append(_Part(ids, tr, np.asarray(table[:, 0])))
            firsts.append(np.asarray(table[:, 1]))
            lasts.append(np.asarray(table[:, 2]))
    except (OSError, KeyError, ValueError, TypeError):
        return None
    if not parts:
        return None
    return TokenStore(parts, np.concatenate(firsts), np.concatenate(lasts), str(folder))
