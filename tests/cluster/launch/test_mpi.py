"""`%nbtrain start --launcher mpi`: settings (always) and real engines started by a real mpiexec
(Debian's openmpi-bin; the tests marked `mpi` skip, saying so, where there is no mpiexec)."""

from __future__ import annotations

import os
import shutil
import time

import psutil
import pytest

import nbtrain
from nbtrain.cluster import facade as core
from nbtrain.cluster.launch import LaunchOptions, mpi
from nbtrain.errors import ClusterError, ConfigError

needs_mpiexec = pytest.mark.skipif(
    shutil.which("mpiexec") is None, reason="no mpiexec here (apt install openmpi-bin)"
)
ROOT_VARS = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")


def _kids() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _left(before: set[int], timeout: float = 10) -> list[str]:
    procs = []
    for pid in _kids() - before:
        try:
            procs.append(psutil.Process(pid))
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    out = []
    for p in alive:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {' '.join(p.cmdline())[:100]}")
        except psutil.Error:
            pass
    return out


@pytest.fixture
def allow_root(monkeypatch):
    # Open MPI refuses root unless told; CI runs as root (a user's notebook should not)
    for name in ROOT_VARS:
        monkeypatch.setenv(name, "1")


# -- settings --------------------------------------------------------------------------------------


def test_rank_count_from_n_or_hosts(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/" + name)
    assert LaunchOptions(launcher="mpi").n == 1
    assert LaunchOptions(launcher="mpi", n=8).n == 8
    lo = LaunchOptions(launcher="mpi", hosts="localhost:3")
    assert lo.n == 3
    assert mpi.mpi_args(lo, "openmpi")[:2] == ["--host", "localhost:3"]
    assert mpi.mpi_args(lo, "hydra")[:2] == ["-hosts", "localhost:3"]
    # Open MPI hands other hosts only the variables -x names: the engines' connection info
    args = mpi.mpi_args(LaunchOptions(launcher="mpi", n=2, mpi_args="--oversubscribe"), "openmpi")
    assert args == [
        "-x",
        "IPP_CONNECTION_INFO",
        "-x",
        "IPP_CLUSTER_ID",
        "-x",
        "IPP_PROFILE_DIR",
    ] + ["--oversubscribe"]


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(n=0), ["-n 0 asks for no engines"]),
        (dict(n=3, hosts="localhost:2"), ["-n 3 does not match --hosts localhost:2"]),
        (dict(hosts="me@localhost"), ["without user@", "~/.ssh/config"]),
        (dict(partition="gpu"), ["--partition is a setting of --launcher slurm"]),
        (dict(ssh_args="-F x"), ["--ssh-args is a setting of --launcher ssh"]),
    ],
)
def test_bad_mpi_settings_start_nothing(kw, words):
    before = _kids()
    with pytest.raises(ConfigError) as e:
        nbtrain.start(launcher="mpi", **kw)
    for w in words:
        assert w in str(e.value)
    assert core.current_cluster() is None and _kids() - before == set()


def test_mpiexec_missing_names_the_command_and_the_fix(ip, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    before = _kids()
    with pytest.raises(ConfigError) as e:
        ip.run_line_magic("nbtrain", "start --launcher mpi -n 2")
    msg = str(e.value)
    assert "--launcher mpi needs mpiexec on PATH" in msg and "apt install openmpi-bin" in msg
    assert "Nothing was started" in msg
    assert core.current_cluster() is None and _kids() - before == set()


# -- real engines under mpiexec --------------------------------------------------------------------


@pytest.mark.mpi
@needs_mpiexec
def test_mpi_cluster_all_reduce_and_stop(ip, allow_root, capsys):
    before = _kids()
    t0 = time.monotonic()
    ip.run_line_magic("nbtrain", "start --launcher mpi -n 2 --timeout 90")
    started = time.monotonic() - t0
    out = capsys.readouterr().out
    cluster = core.require_cluster()
    assert "starting 2 engine(s) with mpiexec" in out and cluster.table() in out
    mpiexec = [
        p for p in psutil.Process().children() if p.name() in ("mpiexec", "mpirun", "orterun")
    ]
    assert len(mpiexec) == 1

    def who():
        import os

        import torch
        import torch.distributed as dist

        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        mpi_rank = os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("PMI_RANK")
        return t.item(), os.environ["RANK"], os.environ["LOCAL_RANK"], mpi_rank

    results = cluster.run(who)
    assert [r[0] for r in results] == [3.0, 3.0]
    # mpiexec places ranks by slot here, so nbtrain's node-major ranks equal MPI's
    assert [r[1:] for r in results] == [("0", "0", "0"), ("1", "1", "1")]
    t1 = time.monotonic()
    ip.run_line_magic("nbtrain", "stop")
    print(f"mpi start {started:.1f} s, stop {time.monotonic() - t1:.1f} s")
    assert not mpiexec[0].is_running() or mpiexec[0].status() == psutil.STATUS_ZOMBIE
    assert _left(before) == []


@pytest.mark.mpi
@needs_mpiexec
@pytest.mark.skipif(os.geteuid() != 0, reason="Open MPI's refusal of root needs root")
def test_mpiexec_refusing_root_says_what_to_do(monkeypatch):
    if mpi.flavour() != "openmpi":
        pytest.skip("this mpiexec is not Open MPI's")
    for name in ROOT_VARS:
        monkeypatch.delenv(name, raising=False)
    before = _kids()
    t0 = time.monotonic()
    with pytest.raises(ClusterError) as e:
        nbtrain.start(launcher="mpi", n=2, timeout=60)
    msg = str(e.value)
    assert "mpiexec refused to run as root" in msg
    assert "OMPI_ALLOW_RUN_AS_ROOT=1 and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1" in msg
    assert "Nothing was left running" in msg
    assert time.monotonic() - t0 < 20  # noticed when mpiexec exits, not at --timeout
    assert core.current_cluster() is None and _left(before) == []


@pytest.mark.mpi
@needs_mpiexec
def test_more_ranks_than_slots_says_oversubscribe(allow_root):
    if mpi.flavour() != "openmpi":
        pytest.skip("this mpiexec is not Open MPI's")
    before = _kids()
    n = (os.cpu_count() or 1) + 1
    with pytest.raises(ClusterError) as e:
        nbtrain.start(launcher="mpi", n=n, timeout=60)
    msg = str(e.value)
    assert msg.startswith("mpiexec exited") and "There are not enough slots available" in msg
    assert "pass --mpi-args --oversubscribe" in msg
    assert core.current_cluster() is None and _left(before) == []
