"""nbtrain.ClusterPicker over SSH on simulated nodes: the form starts a real 2-node cluster."""

from __future__ import annotations

import shlex

import pytest

import nbtrain
from nbtrain.display import picker as pk

from .test_ssh_cluster import _assert_nothing_left, _local_ipp_pids
from .testbed import Testbed

pytestmark = pytest.mark.timeout(240)


def test_picker_starts_a_two_node_cluster_over_ssh(testbed: Testbed, tmp_path, monkeypatch):
    monkeypatch.setenv("NBTRAIN_HOME", str(tmp_path))
    n1, n2 = testbed.nodes[0], testbed.nodes[1]
    before = _local_ipp_pids()
    p = pk.ClusterPicker(probe_max_bytes=1024)
    p.launcher.value = "ssh"
    p.hosts.value = f"{n1.name}:1,{n2.name}:1"
    p.python.value = testbed.remote_python
    p.ssh_args.value = shlex.join(testbed.ssh_args)
    p.backend.value = "gloo"
    p.timeout.value = 90
    p.start_button.click()
    p.wait(120)
    assert p.error.value == "", p.error.value
    cluster = p.cluster
    try:
        assert nbtrain.current_cluster() is cluster
        assert [r.host for r in cluster.ranks] == [n1.name, n2.name]
        for r in cluster.ranks:
            assert f"<td>{r.host}</td>" in p.topology.value
            assert f"<td>{r.address}</td>" in p.topology.value
            assert f"<td>{r.interface}</td>" in p.topology.value
        # preflight ran on both nodes: the version table lists them, nothing highlighted
        assert 'class="nbtrain-preflight"' in p.versions.value
        assert n1.name in p.versions.value and n2.name in p.versions.value
        assert "nbtrain-odd" not in p.versions.value
        p.probe_button.click()
        p.wait(120)
        assert p.error.value == "", p.error.value
        assert "all_reduce across 2 rank(s), backend gloo" in p.probe_out.value
        assert "node-to-node latency" in p.probe_out.value
        # restored next time, ssh settings included
        again = pk.ClusterPicker()
        assert again.settings() == p.settings()
    finally:
        p.stop_button.click()
    assert cluster.stopped
    _assert_nothing_left(testbed, before)
