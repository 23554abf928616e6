"""The one way nbtrain writes a file or a folder so that a reader sees the old one or the new one, never half.

A file: written under a temporary name in the same folder, flushed, fsynced, renamed over the old one
with `os.replace` (atomic on POSIX within one filesystem), then the folder fsynced so the rename
itself survives a crash. A folder: filled under a temporary sibling name, every file and folder in it
fsynced, the old folder (if any) renamed aside, the new one renamed into place, the parent fsynced,
the old one removed. A kill at any instant leaves the old or the new whole, and at most a temporary
name (dot-prefixed, ``.tmp-``/``.old-``) for the next writer or a sweep to remove.

This is a bottom module: it imports nothing of nbtrain, so the rank runtime, the kernel side and
the Jupyter server side may all use it. It is the one module of nbtrain that calls `os.replace`,
`os.rename`, `Path.rename`/`Path.replace` or `os.fsync`.

- `write_text`, `write_bytes`, `write_json`: a whole small file at once;
- `open_file`: a context manager yielding a file object to write into (for a writer that streams);
- `temp_path`: a context manager yielding a temporary path for a writer that takes a path
  (`torch.save`, `save_file`), moved into place on success;
- `folder`: a context manager yielding a temporary folder to fill (`save_pretrained`), moved into
  place on success; `open_dir` / `commit_dir` are its two halves, for a folder other ranks fill
  between them; `write_dir` takes the filling function instead;
- `remove_tree`: delete a folder so that it is whole or gone, never half-deleted;
- `fsync_file`, `fsync_dir`, `fsync_tree`: the flushes themselves.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)

#: temporary names: dot-prefixed so a reader's glob of ``*.json`` and friends never picks them up
TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"

StrPath = str | os.PathLike[str]


def _token() -> str:
    # the pid tells which process left a leftover; the random part keeps two threads (or two
    # hosts sharing a folder, where pids collide) apart
    return f"{os.getpid()}-{secrets.token_hex(4)}"


def _sibling(path: Path, prefix: str) -> Path:
    return path.with_name(f"{prefix}{path.name}-{_token()}")


# ------------------------------------------------------------------------------------------ fsync
def fsync_file(path: StrPath) -> None:
    """Flush a written file's data to disk (opened read-only: fsync needs only a descriptor)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: StrPath) -> None:
    """Flush a folder's entries (a rename or a new name in it) to disk."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        # a folder that cannot be opened (Windows, some network filesystems): its entries are
        # as durable as that filesystem makes them; the rename itself was atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        # some filesystems (certain FUSE and network mounts) refuse to fsync a directory: nothing
        # more can be done there, and the write is still old-or-new for every reader
        pass
    finally:
        os.close(fd)


def fsync_tree(path: StrPath) -> None:
    """fsync every file and every folder under `path`, `path` included."""
    for root, _dirs, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            if not os.path.islink(full):
                fsync_file(full)
        fsync_dir(root)


# ------------------------------------------------------------------------------------------ files
@contextlib.contextmanager
def open_file(
    path: StrPath, mode: str = "w", *, perms: int = 0o666, encoding: str | None = None
) -> Iterator[IO[Any]]:
    """A file object to write `path`'s new content into; on a clean exit it is flushed, fsynced
    and renamed over `path`. On an error the temporary file is removed and `path` is untouched.

    `mode`: "w" (text) or "wb"; `perms`: the new file's permission bits (before the umask, as for
    `open`; 0o600 for a file that names pids or secrets). The parent folder is created."""
    if mode not in ("w", "wb"):
        raise ValueError(f"open_file writes a whole file: mode 'w' or 'wb', not {mode!r}")
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.{_token()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, perms)
    try:
        if "b" in mode:
            f: IO[Any] = os.fdopen(fd, mode)
        else:
            f = os.fdopen(fd, mode, encoding=encoding or "utf-8")
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    try:
        with f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(final.parent)


def write_bytes(path: StrPath, data: bytes, *, perms: int = 0o666) -> Path:
    """Write `data` to `path`: old content or new, never half. Returns the path."""
    with open_file(path, "wb", perms=perms) as f:
        f.write(data)
    return Path(path)


def write_text(path: StrPath, text: str, *, perms: int = 0o666, encoding: str = "utf-8") -> Path:
    """Write `text` to `path`: old content or new, never half. Returns the path."""
    with open_file(path, "w", perms=perms, encoding=encoding) as f:
        f.write(text)
    return Path(path)


def write_json(path: StrPath, data: Any, *, perms: int = 0o666, **dumps: Any) -> Path:
    """Write `json.dumps(data, **dumps)` to `path` (serialised first: a value that cannot be
    written leaves the old file as it was). Returns the path."""
    return write_text(path, json.dumps(data, **dumps), perms=perms)


@contextlib.contextmanager
def temp_path(path: StrPath) -> Iterator[Path]:
    """A temporary path beside `path` for a writer that takes a path (`torch.save`, safetensors'
    `save_file`); on a clean exit the file written there is fsynced and renamed over `path`."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.{_token()}.tmp")
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(final.parent)


# ---------------------------------------------------------------------------------------- folders
def open_dir(final: StrPath) -> Path:
    """Create and return the empty temporary sibling of folder `final` that `commit_dir` renames to
    `final` (``.tmp-<name>-<pid>-<random>``; the parent is created)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(final, TMP_PREFIX)
    tmp.mkdir()
    return tmp


def commit_dir(tmp: StrPath, final: StrPath, *, replace: bool = True) -> Path:
    """fsync everything in the filled folder `tmp` and rename it to `final`.

    An existing `final` is renamed aside first, then removed once the new one is in place, so at
    every instant one complete folder is in place or aside. `replace=False`: an existing non-empty
    `final` is kept and the rename fails with OSError (another writer's twin landed first; `tmp`
    is left for the caller to remove)."""
    tmp, final = Path(tmp), Path(final)
    parent = final.parent
    fsync_tree(tmp)
    old = None
    if replace and final.exists():
        old = _sibling(final, OLD_PREFIX)
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        if old is not None:
            os.replace(old, final)  # put the old one back: the failed write changed nothing
        raise
    fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


@contextlib.contextmanager
def folder(final: StrPath, *, replace: bool = True) -> Iterator[Path]:
    """A temporary folder to fill; on a clean exit it becomes `final` (`commit_dir`). On an error,
    or if the rename fails, the temporary folder is removed and `final` is as it was."""
    tmp = open_dir(final)
    try:
        yield tmp
        commit_dir(tmp, final, replace=replace)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_dir(
    final: StrPath,
    fill: Callable[[Path], None],
    tmp: StrPath | None = None,
    *,
    replace: bool = True,
) -> Path:
    """Create folder `final` by `fill(tmp)` into a temporary sibling, then `commit_dir`. `tmp`: a
    temporary folder opened already (`open_dir`), which other processes may have written into."""
    tmp = open_dir(final) if tmp is None else Path(tmp)
    try:
        fill(tmp)
        return commit_dir(tmp, final, replace=replace)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_tree(path: StrPath, prefix: str = TMP_PREFIX + "delete-") -> None:
    """Delete folder `path` whole or not at all: renamed to a dot-prefixed temporary name first (a
    reader never sees a half-deleted folder that still looks complete), then removed. A kill
    midway leaves the renamed leftover, which a sweep of ``.tmp-*`` removes."""
    path = Path(path)
    doomed = _sibling(path, prefix)
    os.replace(path, doomed)
    fsync_dir(path.parent)
    shutil.rmtree(doomed, ignore_errors=True)
