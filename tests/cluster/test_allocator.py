"""The malloc local CPU engines run with (nbtrain/cluster/allocator.py): tcmalloc where installed.

The choice logic is checked on its own; then real engines are started and asked, from their own memory
maps, which malloc they run with.
"""

from __future__ import annotations

import pytest

import nbtrain
from nbtrain.cluster import allocator
from nbtrain.errors import ConfigError

TCMALLOC = allocator.find_tcmalloc()
needs_tcmalloc = pytest.mark.skipif(
    TCMALLOC is None,
    reason="tcmalloc is not installed here (scripts/testbed-deps.sh installs libtcmalloc-minimal4)",
)


def test_resolve_reads_the_argument_then_the_environment(monkeypatch):
    monkeypatch.delenv("NBTRAIN_ALLOCATOR", raising=False)
    assert allocator.resolve(None) == "auto"
    assert allocator.resolve("System") == "system"
    monkeypatch.setenv("NBTRAIN_ALLOCATOR", "system")
    assert allocator.resolve(None) == "system"
    assert allocator.resolve("tcmalloc") == "tcmalloc"  # the argument wins
    monkeypatch.setenv("NBTRAIN_ALLOCATOR", "mimalloc")
    with pytest.raises(
        ConfigError,
        match=r"'mimalloc' is not one of auto, tcmalloc, system \(from NBTRAIN_ALLOCATOR\)",
    ):
        allocator.resolve(None)
    with pytest.raises(
        ConfigError, match="'fast' is not one of auto, tcmalloc, system.*--allocator"
    ):
        nbtrain.start(n=1, allocator="fast")


def test_allocator_is_for_local_engines_only():
    with pytest.raises(ConfigError, match="not with --launcher ssh"):
        nbtrain.start(launcher="ssh", hosts="node1:2", allocator="tcmalloc")


def test_system_and_gpu_machines_get_nothing(monkeypatch):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert allocator.engine_env("system", {}, gpus=0) == {}
    assert allocator.engine_env("auto", {}, gpus=8) == {}


def test_a_preload_the_user_set_is_kept(monkeypatch, tmp_path):
    lib = tmp_path / "libtcmalloc_minimal.so.4"
    lib.write_bytes(b"")
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: str(lib))
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", raising=False)
    got = allocator.engine_env("auto", {}, gpus=0)
    assert got["LD_PRELOAD"] == str(lib)
    assert int(got["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]) >= 1 << 40
    # another preload: ours goes first, theirs stays
    assert allocator.engine_env("auto", {"LD_PRELOAD": "/opt/libx.so"}, gpus=0)["LD_PRELOAD"] == (
        f"{lib}:/opt/libx.so"
    )
    # the user's own allocator, in env or in the kernel's environment: left alone
    assert allocator.engine_env("auto", {"LD_PRELOAD": "/opt/libjemalloc.so.2"}, gpus=0) == {}
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libtcmalloc.so.4")
    assert allocator.engine_env("tcmalloc", {}, gpus=0) == {}


def test_tcmalloc_asked_for_but_missing_says_how_to_install(monkeypatch):
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: None)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert allocator.engine_env("auto", {}, gpus=0) == {}  # auto: quietly the system's
    with pytest.raises(ConfigError) as e:
        allocator.engine_env("tcmalloc", {}, gpus=0)
    assert "no tcmalloc library on" in str(e.value)
    assert "apt-get install libtcmalloc-minimal4" in str(e.value)
    assert "--allocator system" in str(e.value)


@needs_tcmalloc
def test_cpu_engines_run_with_tcmalloc_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("NBTRAIN_ALLOCATOR", raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    # CPU engines: on a machine with GPUs, hide them (auto leaves GPU machines' malloc alone)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")

    def report() -> tuple[str, str | None, float]:
        import os

        import torch

        from nbtrain.engine.setup import allocator_in_use

        x = torch.ones(512, 512)
        return allocator_in_use(), os.environ.get("LD_PRELOAD"), float((x @ x).sum())

    cluster = nbtrain.start(n=2, force=True)
    try:
        assert cluster.allocator == "tcmalloc"
        for name, preload, total in cluster.run(report):
            assert name == "tcmalloc"
            assert preload == TCMALLOC
            assert total == 512.0**3
    finally:
        cluster.stop()
    cluster = nbtrain.start(n=1, force=True, allocator="system")
    try:
        assert cluster.allocator == "system"
        [(name, preload, _)] = cluster.run(report)
        assert name == "system" and preload is None
    finally:
        cluster.stop()


@needs_tcmalloc
def test_the_magic_says_which_malloc(ip, capsys, monkeypatch):
    monkeypatch.delenv("NBTRAIN_ALLOCATOR", raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    ip.run_line_magic("nbtrain", "start -n 1 --force --allocator system --backend gloo")
    try:
        out = capsys.readouterr().out
        assert "backend gloo, malloc system" in out
        assert "tip" not in out  # asked for system: no advice
    finally:
        ip.run_line_magic("nbtrain", "stop")
