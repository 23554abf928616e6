"""nbtrain/atomic.py: a reader sees the old file or folder or the new one, never half, and the writes
are flushed (fsync of the file and of its folder)."""

from __future__ import annotations

import json
import os
import stat

import pytest

from nbtrain import atomic


def _names(folder):
    return sorted(p.name for p in folder.iterdir())


class Planted(Exception):
    """The failure planted half way through a write."""


# ------------------------------------------------------------------------------------------ files
def test_write_text_bytes_json_replace_the_old_content(tmp_path):
    p = tmp_path / "sub" / "f.json"
    atomic.write_json(p, {"a": 1}, sort_keys=True)
    assert json.loads(p.read_text()) == {"a": 1}
    atomic.write_text(p, "two")
    assert p.read_text() == "two"
    atomic.write_bytes(p, b"\x00three")
    assert p.read_bytes() == b"\x00three"
    assert _names(p.parent) == ["f.json"]  # no temporary file left


def test_a_failure_half_way_leaves_the_old_file_and_no_temp(tmp_path):
    p = tmp_path / "record.json"
    atomic.write_text(p, "old")
    with pytest.raises(Planted), atomic.open_file(p) as f:
        f.write("new, half")
        f.flush()
        # the half-written content is on disk under another name; the reader still sees the old
        assert p.read_text() == "old"
        raise Planted
    assert p.read_text() == "old"
    assert _names(tmp_path) == ["record.json"]


def test_a_value_that_cannot_be_written_leaves_the_old_file(tmp_path):
    p = tmp_path / "state.json"
    atomic.write_json(p, {"ok": True})
    with pytest.raises(TypeError):
        atomic.write_json(p, {"bad": object()})
    assert json.loads(p.read_text()) == {"ok": True}
    assert _names(tmp_path) == ["state.json"]


def test_temp_path_for_a_writer_that_takes_a_path(tmp_path):
    p = tmp_path / "optimizer.pt"
    with atomic.temp_path(p) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".")
        tmp.write_bytes(b"new")
        assert not p.exists()
    assert p.read_bytes() == b"new"
    with pytest.raises(Planted), atomic.temp_path(p) as tmp:
        tmp.write_bytes(b"half")
        raise Planted
    assert p.read_bytes() == b"new"
    assert _names(tmp_path) == ["optimizer.pt"]


def test_perms_make_a_private_file(tmp_path):
    p = tmp_path / "side.json"
    atomic.write_json(p, {}, perms=0o600)
    assert stat.S_IMODE(p.stat().st_mode) == 0o600


def test_file_and_folder_are_fsynced(tmp_path, monkeypatch):
    synced = []
    real = os.fsync

    def recording(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}") if os.path.exists("/proc/self/fd") else fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    p = tmp_path / "metrics.jsonl"
    atomic.write_text(p, "{}\n")
    assert p.read_text() == "{}\n"
    assert len(synced) == 2  # the file's data, then the folder's entry for the rename
    if os.path.exists("/proc/self/fd"):
        assert synced[0].startswith(
            str(tmp_path / ".metrics.jsonl.")
        )  # the file, before its rename
        assert synced[1] == str(tmp_path)


def test_a_folder_that_cannot_be_fsynced_is_tolerated(tmp_path, monkeypatch):
    real = os.fsync

    def no_dirs(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(22, "Invalid argument")  # as some network filesystems answer
        real(fd)

    monkeypatch.setattr(os, "fsync", no_dirs)
    atomic.write_text(tmp_path / "f", "x")
    with atomic.folder(tmp_path / "d") as tmp:
        (tmp / "a").write_text("a")
    assert (tmp_path / "f").read_text() == "x" and (tmp_path / "d" / "a").read_text() == "a"


# ---------------------------------------------------------------------------------------- folders
def test_folder_replaces_the_old_one_whole(tmp_path):
    final = tmp_path / "adapter"
    with atomic.folder(final) as tmp:
        (tmp / "a.txt").write_text("v1")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b.txt").write_text("v1")
        assert not final.exists()  # nothing in place until the folder is whole
    with atomic.folder(final) as tmp:
        (tmp / "a.txt").write_text("v2")
    assert _names(final) == ["a.txt"] and (final / "a.txt").read_text() == "v2"
    assert _names(tmp_path) == ["adapter"]  # neither the temporary nor the old one is left


def test_a_failure_half_way_leaves_the_old_folder_and_no_temp(tmp_path):
    final = tmp_path / "checkpoint-1"
    with atomic.folder(final) as tmp:
        (tmp / "a.txt").write_text("v1")
    with pytest.raises(Planted), atomic.folder(final) as tmp:
        (tmp / "a.txt").write_text("v2")
        raise Planted
    assert (final / "a.txt").read_text() == "v1"
    with pytest.raises(KeyboardInterrupt):  # a kill mid-save, via write_dir

        def dies(tmp):
            (tmp / "a.txt").write_text("v3")
            raise KeyboardInterrupt

        atomic.write_dir(final, dies)
    assert (final / "a.txt").read_text() == "v1"
    with pytest.raises(Planted), atomic.folder(tmp_path / "new") as tmp:
        raise Planted
    assert _names(tmp_path) == ["checkpoint-1"]


def test_a_failed_rename_puts_the_old_folder_back(tmp_path, monkeypatch):
    final = tmp_path / "state"
    with atomic.folder(final) as tmp:
        (tmp / "a.txt").write_text("v1")
    real = os.replace

    def fails_into_place(src, dst):
        if os.path.basename(src).startswith(atomic.TMP_PREFIX):
            raise OSError(28, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(os, "replace", fails_into_place)
    with pytest.raises(OSError), atomic.folder(final) as tmp:
        (tmp / "a.txt").write_text("v2")
    assert (final / "a.txt").read_text() == "v1"
    assert _names(tmp_path) == ["state"]


def test_replace_false_keeps_a_twin_that_landed_first(tmp_path):
    final = tmp_path / "tiny"
    with atomic.folder(final) as tmp:
        (tmp / "config.json").write_text("first")
    with pytest.raises(OSError), atomic.folder(final, replace=False) as tmp:
        (tmp / "config.json").write_text("second")
    assert (final / "config.json").read_text() == "first"
    assert _names(tmp_path) == ["tiny"]


def test_open_dir_then_commit_dir(tmp_path):
    final = tmp_path / "cache"
    tmp = atomic.open_dir(final)
    assert tmp.parent == tmp_path and tmp.name.startswith(atomic.TMP_PREFIX + "cache-")
    (tmp / "part-0").write_bytes(b"0")  # other ranks fill it between the two calls
    assert atomic.commit_dir(tmp, final) == final
    assert _names(final) == ["part-0"] and not tmp.exists()


def test_every_file_and_folder_of_a_folder_is_fsynced(tmp_path, monkeypatch):
    synced = []
    real = os.fsync

    def recording(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    if not os.path.exists("/proc/self/fd"):
        pytest.skip("needs /proc to name the fsynced descriptors")
    monkeypatch.setattr(os, "fsync", recording)
    final = tmp_path / "merged"
    with atomic.folder(final) as tmp:
        (tmp / "a").write_text("a")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b").write_text("b")
    rel = sorted(os.path.relpath(p, tmp) for p in synced if p.startswith(str(tmp)))
    assert rel == [".", "a", "sub", "sub/b"]  # every file and folder, before the rename
    assert synced[-1] == str(tmp_path)  # then the parent, for the rename itself


def test_remove_tree_is_whole_or_gone(tmp_path, monkeypatch):
    doomed = tmp_path / "checkpoint-1"
    (doomed / "sub").mkdir(parents=True)
    (doomed / "sub" / "x").write_text("x")
    atomic.remove_tree(doomed)
    assert _names(tmp_path) == []
    # killed after the rename, before the removal: the folder is gone under its own name
    (doomed / "sub").mkdir(parents=True)
    monkeypatch.setattr(atomic.shutil, "rmtree", lambda *a, **k: None)
    atomic.remove_tree(doomed)
    left = _names(tmp_path)
    assert len(left) == 1 and left[0].startswith(".tmp-delete-checkpoint-1-")
