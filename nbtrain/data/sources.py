"""Where training rows come from, read a part at a time so that no rank holds the whole data set.

A source is a file (JSONL, JSON, Parquet, CSV) or rows already in memory (a list of dicts, a pandas
DataFrame, a `datasets.Dataset`). `Source.part(k, n)` yields the rows of part k of n with each row's
1-based line in its file where it has one, so a bad row is reported where an editor shows it:

- JSONL is split by byte ranges (a part owns the lines that start in its range) and streamed line by
  line: a file larger than memory works, and no rank reads another's lines.
- Parquet is read one row group at a time, only the groups that hold the part's rows.
- JSON arrays and CSV have no cheap way to find row k, so each part parses the file and keeps its
  slice: use JSONL or Parquet for data sets that do not fit in memory.

A part's row numbers are local (0, 1, ...): a JSONL part does not know how many rows come before it
until every part has been read. `Source.fingerprint()` is a digest of the data's content.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nbtrain import atomic
from nbtrain.errors import ConfigError

log = logging.getLogger(__name__)

SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


def plain(value: Any) -> Any:
    """numpy/pandas values (from DataFrames and Parquet) as plain Python, NaN as None."""
    if hasattr(value, "tolist") and not isinstance(value, str):
        value = value.tolist()
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def _record(row: dict) -> dict:
    # a CSV or DataFrame mixing formats has NaN where a row lacks a column: treat it as absent
    return {k: v for k, v in ((k, plain(v)) for k, v in row.items()) if v is not None}


def _span(n: int, k: int, parts: int) -> tuple[int, int]:
    """Rows [lo, hi) of part k of `parts` over n rows: contiguous, sizes differing by at most one."""
    return n * k // parts, n * (k + 1) // parts


@dataclass
class BadLine:
    """A JSONL line that is not JSON, in place of its row (`Source.part(..., bad_lines=True)`): the
    reader goes on, so it is reported with the data's other bad rows."""

    problem: str  #: what the parser said, e.g. "Expecting ',' delimiter at column 25"


def json_problem(e: json.JSONDecodeError) -> str:
    """The parser's complaint and where in the line: "Unterminated string starting at column 9"."""
    return f"{e.msg} column {e.colno}" if e.msg.endswith(" at") else f"{e.msg} at column {e.colno}"


@dataclass
class Row:
    """One row of a part: its number within the part, and where it is in its file (if anywhere)."""

    local: int
    value: Any
    line: int | None = None  #: 1-based line, where known without counting
    byte: int | None = None  #: offset of its line in a JSONL file (the line is counted on demand)
    fraction: float = 0.0  #: how much of its part is read up to this row (for progress)


class Source:
    """Rows of one data argument (`data` or `eval_data`), readable in parts."""

    def __init__(self, source: Any, name: str = "data") -> None:
        self.name = name
        self.path: Path | None = None
        self._rows: Sequence[Any] | None = None
        self._frame: Any = None
        self._dataset: Any = None
        if isinstance(source, str | os.PathLike):
            path = Path(source).expanduser()
            if not path.is_file():
                msg = (
                    f"{name} file {os.fspath(source)!r} not found; check the path (relative paths "
                    f"are from {os.getcwd()})"
                )
                raise ConfigError(msg)
            self.suffix = path.suffix.lower()
            if self.suffix not in SUFFIXES:
                msg = f"{name} file {str(path)!r} has an unknown suffix; use .jsonl, .json, .parquet or .csv"
                raise ConfigError(msg)
            if self.suffix == ".json" and not _starts_with_bracket(path):
                self.suffix = ".jsonl"  # JSON lines saved as .json
            self.path = path.resolve()
            self.where = f"{name} file {str(path)!r}"
        elif hasattr(source, "to_dict") and hasattr(source, "columns"):  # pandas DataFrame
            self._frame = source
            self.where = f"{name} DataFrame"
        elif hasattr(source, "to_list") and hasattr(source, "column_names"):  # datasets.Dataset
            self._dataset = source
            self.where = f"{name} Dataset"
        elif isinstance(source, Sequence) and not isinstance(source, str | bytes):
            self._rows = source
            self.where = f"{name} list"
        else:
            msg = (
                f"{name} of type {type(source).__name__} is not supported; pass a "
                ".jsonl/.json/.parquet/.csv path, a list of dicts, a pandas DataFrame or a "
                "datasets.Dataset"
            )
            raise ConfigError(msg)

    # ------------------------------------------------------------------------------------- reading
    def part(self, k: int = 0, parts: int = 1, bad_lines: bool = False) -> Iterator[Row]:
        """The rows of part `k` of `parts`, in order; together the parts are every row, once.

        A JSONL line that is not JSON is a ConfigError, or with `bad_lines` a row whose value is a
        `BadLine`, for the caller to report with the other bad rows."""
        if self.path is None:
            yield from self._memory_part(k, parts)
        elif self.suffix == ".jsonl":
            yield from self._jsonl_part(k, parts, bad_lines)
        elif self.suffix == ".parquet":
            yield from self._parquet_part(k, parts)
        else:
            yield from self._parsed_part(k, parts)

    def rows(self) -> list[Any]:
        """Every row, in memory (small data: evaluation rows, tests)."""
        return [r.value for r in self.part(0, 1)]

    def _memory_part(self, k: int, parts: int) -> Iterator[Row]:
        if self._rows is not None:
            n = len(self._rows)
            lo, hi = _span(n, k, parts)
            for i in range(lo, hi):
                yield Row(i - lo, self._rows[i], fraction=(i - lo) / (hi - lo))
        elif self._frame is not None:
            lo, hi = _span(len(self._frame), k, parts)
            for i, row in enumerate(self._frame.iloc[lo:hi].to_dict(orient="records")):
                yield Row(i, _record(row))
        else:
            lo, hi = _span(len(self._dataset), k, parts)
            step = 1000
            for start in range(lo, hi, step):
                chunk = self._dataset.select(range(start, min(start + step, hi))).to_list()
                for j, row in enumerate(chunk):
                    yield Row(start - lo + j, plain(row))

    def _jsonl_part(self, k: int, parts: int, bad_lines: bool) -> Iterator[Row]:
        assert self.path is not None
        size = self.path.stat().st_size
        lo, hi = size * k // parts, size * (k + 1) // parts
        with self.path.open("rb") as f:
            if lo > 0:
                # a line belongs to the part its first byte is in: skip the one that started before lo
                f.seek(lo - 1)
                f.readline()
            pos = f.tell()
            local = 0
            while pos < hi:
                raw = f.readline()
                if not raw:
                    break
                start = pos
                pos += len(raw)
                if not raw.strip():
                    continue
                try:
                    value = json.loads(raw)
                except json.JSONDecodeError as e:
                    if not bad_lines:
                        lineno = self.line_of(start)
                        msg = (
                            f"{self.where}: line {lineno} is not valid JSON ({json_problem(e)}); "
                            "fix or remove that line"
                        )
                        raise ConfigError(msg) from None
                    value = BadLine(json_problem(e))
                yield Row(local, value, byte=start, fraction=(pos - lo) / max(hi - lo, 1))
                local += 1

    def line_of(self, byte: int) -> int:
        """The 1-based line of the line starting at `byte` of the file (counted on demand)."""
        assert self.path is not None
        count = 1
        with self.path.open("rb") as f:
            left = byte
            while left > 0:
                chunk = f.read(min(left, 1 << 22))
                if not chunk:
                    break
                count += chunk.count(b"\n")
                left -= len(chunk)
        return count

    def line(self, row: Row) -> int | None:
        """The 1-based line of `row` in its file (None for rows not read from a text file)."""
        if row.byte is not None:
            return self.line_of(row.byte)
        return row.line

    def row_where(self, row: Row) -> str:
        """How a message names where `row` is: the file and its line, or just the argument's name."""
        if self.path is None:
            return self.name
        line = self.line(row)
        return self.where if line is None else f"{self.where} line {line}"

    def _parquet_part(self, k: int, parts: int) -> Iterator[Row]:
        import pyarrow.parquet as pq

        f = pq.ParquetFile(self.path)
        lo, hi = _span(f.metadata.num_rows, k, parts)
        first = 0
        local = 0
        for g in range(f.num_row_groups):
            n = f.metadata.row_group(g).num_rows
            a, b = max(lo, first), min(hi, first + n)
            if a < b:
                table = f.read_row_group(g).slice(a - first, b - a)
                for row in table.to_pylist():
                    yield Row(local, _record(row))
                    local += 1
            first += n

    def _parsed_part(self, k: int, parts: int) -> Iterator[Row]:
        assert self.path is not None
        if self.suffix == ".csv":
            import pandas as pd

            frame = pd.read_csv(self.path)
            lo, hi = _span(len(frame), k, parts)
            for i, row in enumerate(frame.iloc[lo:hi].to_dict(orient="records")):
                # line 1 is the header; a CSV row with quoted newlines spans more than one line
                yield Row(i, _record(row))
            return
        text = self.path.read_text(encoding="utf-8")
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            msg = (
                f"{self.where}: invalid JSON at line {e.lineno} ({json_problem(e)}); fix that line"
            )
            raise ConfigError(msg) from None
        if not isinstance(rows, list):
            msg = f"{self.where} holds a JSON {type(rows).__name__}, not a list of rows; write a JSON list or JSONL"
            raise ConfigError(msg)
        lo, hi = _span(len(rows), k, parts)
        for i in range(lo, hi):
            yield Row(i - lo, rows[i])

    # ------------------------------------------------------------------------------------ identity
    def fingerprint(self, memo: Path | None = None) -> str:
        """A digest of the data's content (the file's bytes, or the rows themselves).

        A file's digest is kept in the JSON file `memo` under its path, size, modification time and
        inode: a warm start does not read a large file again while none of those changed."""
        if self.path is not None and memo is not None:
            st = self.path.stat()
            key = f"{self.path}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
            try:
                known = json.loads(memo.read_text())
            except (OSError, ValueError):
                known = {}
            if not isinstance(known, dict):
                known = {}
            if isinstance(known.get(key), str):
                return known[key]
            digest = self.fingerprint()
            known = {k: v for k, v in known.items() if not k.startswith(f"{self.path}|")}
            known[key] = digest
            try:
                atomic.write_json(memo, known)
            except OSError:  # a read-only cache folder: the digest is made again next time
                pass
            return digest
        h = hashlib.blake2b(digest_size=16)
        if self.path is not None:
            h.update(self.suffix.encode())
            with self.path.open("rb") as f:
                while chunk := f.read(1 << 22):
                    h.update(chunk)
        elif self._dataset is not None and getattr(self._dataset, "_fingerprint", None):
            h.update(b"dataset:" + str(self._dataset._fingerprint).encode())
        else:
            for r in self.part(0, 1):
                h.update(json.dumps(r.value, sort_keys=True, default=str).encode())
                h.update(b"\n")
        return h.hexdigest()


def _starts_with_bracket(path: Path) -> bool:
    with path.open("rb") as f:
        while chunk := f.read(4096):
            stripped = chunk.lstrip()
            if stripped:
                return stripped.startswith(b"[")
    return False
