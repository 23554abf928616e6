"""Incremental reads of a run's ``metrics.jsonl`` and ``samples.jsonl`` for the browser's polling.

The browser asks "rows after step K" every couple of seconds. Re-reading and re-parsing the whole
file each time costs O(steps) per poll, so each file keeps a cursor: the byte offset parsed so far
and the rows seen. Only the bytes appended since the last poll are read.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class RefusedPath(Exception):
    """A metrics path that resolves outside its registered run folder."""


def folder_file(folder: str, name: str) -> Path:
    """The file `name` inside a registered folder; refuses one that resolves outside it.

    The folder itself comes from the runs registry, never from the request. A symlinked file that
    points elsewhere is refused rather than followed.
    """
    base = Path(folder).resolve()
    path = (base / name).resolve()
    if path.parent != base:
        msg = f"{base / name} resolves to {path}, outside its run folder"
        raise RefusedPath(msg)
    return path


def _finite(value: Any) -> Any:
    # JSON.parse in the browser rejects NaN/Infinity, which Python's json writes happily
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


@dataclass
class _Cursor:
    inode: int = -1
    offset: int = 0
    rows: list[dict[str, Any]] = field(default_factory=list)


class MetricsReader:
    """Parsed rows per metrics file, extended by reading only what was appended.

    `parse` reads one line into a row (None skips it); the default reads a metrics row. The samples
    file's reader passes `parse_sample`.
    """

    def __init__(
        self,
        max_files: int = 64,
        parse: Callable[[bytes], dict[str, Any] | None] | None = None,
    ) -> None:
        self._cursors: dict[Path, _Cursor] = {}
        self._lock = threading.Lock()
        self._max_files = max_files
        self._parse = parse or _parse

    def rows(self, path: Path) -> list[dict[str, Any]]:
        """Every complete row of `path` so far (a trailing half-written line waits for its newline)."""
        with self._lock:
            try:
                st = path.stat()
            except FileNotFoundError:
                self._cursors.pop(path, None)
                return []
            cursor = self._cursors.get(path)
            if cursor is None or cursor.inode != st.st_ino or st.st_size < cursor.offset:
                # new, replaced or truncated (a run restarted into the same folder): start over
                cursor = _Cursor(inode=st.st_ino)
                if len(self._cursors) >= self._max_files:
                    self._cursors.pop(next(iter(self._cursors)))
                self._cursors[path] = cursor
            if st.st_size > cursor.offset:
                with open(path, "rb") as f:
                    f.seek(cursor.offset)
                    chunk = f.read(st.st_size - cursor.offset)
                end = chunk.rfind(b"\n") + 1
                for line in chunk[:end].splitlines():
                    row = self._parse(line)
                    if row is not None:
                        cursor.rows.append(row)
                cursor.offset += end
            return cursor.rows


def finite_json(value: Any) -> Any:
    """`value` (parsed JSON) with NaN and infinities replaced by None, at any depth."""
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_json(v) for v in value]
    return _finite(value)


def _parse(line: bytes) -> dict[str, Any] | None:
    line = line.strip()
    if not line:
        return None
    try:
        row = json.loads(line)
    except ValueError:
        return None
    if not isinstance(row, dict) or not isinstance(row.get("step"), int | float):
        return None
    return {k: _finite(v) for k, v in row.items()}


def parse_sample(line: bytes) -> dict[str, Any] | None:
    """One samples.jsonl row as `nbtrain.compare.parse_samples` reads it, or None for a bad line."""
    from nbtrain.compare.data import parse_samples

    rows = parse_samples([line])
    return rows[0] if rows else None


def samples_since(
    rows: list[dict[str, Any]], since: float, max_steps: int
) -> tuple[list[dict[str, Any]], bool]:
    """The sample rows of steps >= `since`, whole steps only, at most `max_steps` steps of them, and
    whether more steps remain. The browser asks again from its newest step, so a step whose rows are
    still being appended comes again, whole."""
    # rows are appended step by step: scan back from the end to the first step asked for
    start = len(rows)
    while start > 0 and rows[start - 1]["step"] >= since:
        start -= 1
    picked: list[dict[str, Any]] = []
    steps = 0
    for row in rows[start:]:
        if not picked or row["step"] != picked[-1]["step"]:
            if steps == max_steps:
                return picked, True
            steps += 1
        picked.append(row)
    return picked, False


def rows_after(
    rows: list[dict[str, Any]], after: float, limit: int
) -> tuple[list[dict[str, Any]], bool]:
    """Rows with step > `after`, at most `limit` of them, and whether more remain."""
    # steps only grow within a run, so scan back from the end to the first row already sent
    start = len(rows)
    while start > 0 and rows[start - 1]["step"] > after:
        start -= 1
    picked = rows[start : start + limit]
    return picked, start + limit < len(rows)
