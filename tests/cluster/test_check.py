"""`%nbtrain check` (nbtrain/cluster/check.py, nbtrain/engine/facts.py): the table and what is odd
(synthetic node facts), the Slurm command, a real probe on this machine, a running 2-engine cluster.

SSH on simulated nodes: tests/multinode/test_check_nodes.py; a real srun: tests/cluster/launch/test_slurm.py.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

import nbtrain
from nbtrain.cluster import check as checking
from nbtrain.cluster.check import parse_facts, result_of, srun_command
from nbtrain.engine.facts import MARKER
from nbtrain.errors import ConfigError
from tests.conftest import wait_gone

H100 = {"name": "NVIDIA H100 80GB HBM3", "memory_bytes": 80 * 2**30}


def _node(name: str, **kw) -> dict:
    facts = {
        "hostname": name,
        "cpus": 64,
        "cpus_usable": 64,
        "python": "3.11.9",
        "torch": "2.6.0",
        "cuda": {"version": "12.4", "available": True},
        "nccl": "2.21.5",
        "nbtrain": "0.1.0",
        "gpus": [H100] * 8,
    }
    facts.update(kw)
    return facts


# -- what is odd, and the table --------------------------------------------------------------------


def test_the_odd_node_is_marked_with_the_fix():
    r = result_of([_node("node1"), _node("node2", torch="2.5.1"), _node("node3")], "ssh")
    assert not r.ok
    assert [(m.key, m.odd, m.expected) for m in r.odd] == [("torch", {"node2": "2.5.1"}, "2.6.0")]
    assert r.advice() == [
        "torch 2.5.1 on node2 but 2.6.0 elsewhere: pip install torch==2.6.0 on node2"
    ]
    lines = r.table().splitlines()
    assert lines[0].split() == [
        "node", "CPUs", "Python", "torch", "CUDA", "NCCL", "nbtrain", "GPUs",
    ]  # fmt: skip
    assert lines[1].startswith("  node1") and "*" not in lines[1]
    assert lines[2].startswith("! node2") and " *2.5.1 " in lines[2]
    assert "8x NVIDIA H100 80GB HBM3 80 GiB" in lines[2]
    assert lines[3].startswith("  node3")
    assert "%nbtrain start refuses it" in lines[4]
    text = str(r)
    assert r.table() in text and r.advice()[0] in text


def test_a_tie_counts_the_first_node_as_expected():
    r = result_of([_node("node1", nbtrain="0.2.0"), _node("node2")], "cluster")
    (m,) = r.odd
    assert m.expected == "0.2.0" and m.odd == {"node2": "0.1.0"}
    assert r.advice() == [
        "nbtrain 0.1.0 on node2 but 0.2.0 on node1: pip install nbtrain==0.2.0 on node2"
    ]


def test_gpus_that_differ_warn_and_point_at_nvidia_smi():
    r = result_of([_node("a"), _node("b"), _node("c", gpus=[H100] * 7)], "slurm")
    (m,) = r.odd
    assert m.key == "gpus" and not m.fatal and m.odd == {"c": "7x NVIDIA H100 80GB HBM3 80 GiB"}
    assert "check the GPUs on c (nvidia-smi" in r.advice()[0]
    row = r.table().splitlines()[3]
    assert row.startswith("! c") and "~7x NVIDIA" in row


def test_python_patch_releases_agree_and_fewer_usable_cpus_show():
    r = result_of([_node("a"), _node("b", python="3.11.4", cpus_usable=8)], "slurm")
    assert r.ok and r.odd == []
    row = r.table().splitlines()[2]
    assert "8 of 64" in row and "3.11.4" in row
    assert str(r).endswith("2 node(s) agree: nothing odd.")


def test_a_node_without_facts_is_listed_and_the_rest_compared():
    r = result_of(
        [_node("a"), {"hostname": "b", "error": "cannot log in over SSH: refused"}, _node("c")],
        "ssh",
    )
    assert [n["hostname"] for n in r.nodes] == ["a", "c"]
    assert r.odd == [] and r.failed == {"b": "cannot log in over SSH: refused"} and not r.ok
    assert r.table().splitlines()[-1].split()[:4] == ["x", "b", "no", "answer"]
    assert r.advice() == ["b: no answer (cannot log in over SSH: refused)"]


def test_html_highlights_the_odd_cell_and_carries_the_advice():
    r = result_of([_node("a"), _node("b"), _node("c", nccl="2.18.1")], "ssh")
    page = r._repr_html_()
    assert page.startswith('<table class="nbtrain-check">')
    assert "install NCCL 2.21.5 on c" in page
    assert 'title="differs from the other nodes">2.18.1</td>' in page


def test_probe_lines_are_found_among_other_output():
    text = f'Welcome to node1\n{MARKER}{{"hostname": "n1"}}\nbye\n{MARKER}{{"hostname": "n2"}}'
    assert parse_facts(text) == [{"hostname": "n1"}, {"hostname": "n2"}]


# -- the sources before a start --------------------------------------------------------------------


def test_which_checker_the_settings_pick(monkeypatch):
    seen = {}

    def fake(name):
        def checker(hosts=None, partition=None, nodes=None, timeout=60.0):
            seen[name] = {
                "hosts": hosts,
                "partition": partition,
                "nodes": nodes,
                "timeout": timeout,
            }
            return [_node(name)]

        return checker

    for name in ("local", "ssh", "slurm"):
        monkeypatch.setitem(checking.CHECKERS, name, fake(name))
    assert nbtrain.check().source == "local"
    assert nbtrain.check(hosts="a,b").source == "ssh"
    assert nbtrain.check(partition="gpu", timeout=5).source == "slurm"
    assert seen["slurm"] == {"hosts": None, "partition": "gpu", "nodes": None, "timeout": 5}
    assert nbtrain.check(launcher="ssh", hosts="x").source == "ssh"


def test_a_launcher_without_a_checker_or_a_foreign_setting_is_refused():
    with pytest.raises(ConfigError, match="no check before a start for launcher 'mpi'"):
        nbtrain.check(launcher="mpi")
    with pytest.raises(ConfigError, match="partition: not a setting of the ssh check"):
        nbtrain.check(launcher="ssh", hosts="localhost", partition="gpu")
    with pytest.raises(ConfigError, match="hosts: not a setting of the local check"):
        nbtrain.check(launcher="local", hosts="localhost")


def _fake_slurm(tmp_path: Path, monkeypatch, names=("sbatch", "squeue", "scancel")) -> None:
    for name in names:
        f = tmp_path / name
        f.write_text("#!/bin/sh\nexit 0\n")
        f.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))


def test_srun_command_runs_the_probe_once_per_node(tmp_path, monkeypatch):
    _fake_slurm(tmp_path, monkeypatch)
    cmd = srun_command(
        partition="gpu", nodes="4", account="proj", time="10", slurm_args="--qos=high",
        remote_python="/opt/py",
    )  # fmt: skip
    assert cmd == [
        "srun", "--nodes=4", "--ntasks-per-node=1", "--job-name=nbtrain-check",
        "--partition=gpu", "--account=proj", "--time=10", "--qos=high",
        "/opt/py", "-m", "nbtrain.engine.facts",
    ]  # fmt: skip
    assert srun_command()[:2] == ["srun", "--nodes=1"]
    with pytest.raises(ConfigError, match="--time '2 hours' is not a Slurm time limit"):
        srun_command(time="2 hours")


def test_missing_srun_names_it_and_the_fix(ip, tmp_path, monkeypatch):
    _fake_slurm(tmp_path, monkeypatch)  # sbatch and friends, but no srun
    with pytest.raises(ConfigError) as e:
        ip.run_line_magic("nbtrain", "check --partition gpu")
    assert "srun is not on PATH" in str(e.value) and "module load slurm" in str(e.value)


def test_local_probe_runs_and_reports_this_machine(ip, capsys):
    import torch

    r = nbtrain.check(launcher="local")
    (facts,) = r.nodes
    assert facts["hostname"] == socket.gethostname()
    assert facts["cpus"] == os.cpu_count() and 1 <= facts["cpus_usable"] <= facts["cpus"]
    assert facts["torch"] == torch.__version__
    assert facts["python_executable"] == sys.executable
    assert facts["nbtrain"] == nbtrain.__version__
    assert r.ok
    ip.run_line_magic("nbtrain", "check --launcher local")
    out = capsys.readouterr().out
    assert socket.gethostname() in out and torch.__version__ in out and "nothing odd" in out


# -- a running cluster -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_engines():
    cluster = nbtrain.start(n=2, backend="gloo", force=True)
    yield cluster
    pids = list(cluster._pids)
    cluster.stop()
    assert wait_gone(pids) == []


def test_running_cluster_has_one_row_per_host(ip, two_engines, capsys):
    r = two_engines.check()
    assert r.source == "cluster"
    assert [n["hostname"] for n in r.nodes] == [socket.gethostname()]  # 2 engines, 1 host
    assert r.compared.engines == {socket.gethostname(): 1}  # asked one engine there, not both
    assert r.nodes[0]["torch"] == two_engines.run(lambda: __import__("torch").__version__)[0]
    ip.run_line_magic("nbtrain", "check")
    out = capsys.readouterr().out
    assert "1 host(s) of the running cluster" in out and socket.gethostname() in out
