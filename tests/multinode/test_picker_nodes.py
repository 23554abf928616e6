"""nbtrain.ClusterPicker over SSH on simulated nodes: the form starts a real 2-node cluster.

The nodes get a second network between them (`data0`, a veth pair straight from node 1 to node 2)
and node 1 an interface node 2 lacks (`mgmt0`): names this machine does not have, so a dropdown
that offers them learnt them from the nodes.
"""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import nbtrain
from nbtrain import net
from nbtrain.display import picker as pk

from .test_ssh_cluster import _assert_nothing_left, _local_ipp_pids
from .testbed import Testbed

pytestmark = pytest.mark.timeout(240)

DATA = "data0"  # on both nodes, a network of its own between them
MGMT = "mgmt0"  # on node 1 only
DATA_ADDRESSES = ("192.168.214.11", "192.168.214.12")


@pytest.fixture(scope="module")
def extra_nics(testbed: Testbed) -> Iterator[dict[str, str]]:
    """data0 between node 1 and node 2, mgmt0 on node 1; removed after the module."""
    n1, n2 = testbed.nodes[0], testbed.nodes[1]
    here = {i.name for i in net.interfaces(include_down=True)}
    assert DATA not in here and MGMT not in here, "this machine has the test's interface names"
    subprocess.run(
        ["ip", "link", "add", "nbtpkd1", "netns", n1.netns, "type", "veth"]
        + ["peer", "name", "nbtpkd2", "netns", n2.netns],
        check=True,
        capture_output=True,
    )
    try:
        for node, end, address in ((n1, "nbtpkd1", DATA_ADDRESSES[0]), (n2, "nbtpkd2", DATA_ADDRESSES[1])):  # fmt: skip
            testbed.exec(node, ["ip", "link", "set", end, "name", DATA])
            testbed.exec(node, ["ip", "addr", "add", f"{address}/24", "dev", DATA])
            testbed.exec(node, ["ip", "link", "set", DATA, "up"])
        # no dummy interfaces in every kernel: a veth pair with both ends on node 1 (the peer
        # has no address, so it is no choice)
        testbed.exec(n1, ["ip", "link", "add", MGMT, "type", "veth", "peer", "name", f"{MGMT}p"])
        testbed.exec(n1, ["ip", "addr", "add", "192.168.215.11/24", "dev", MGMT])
        testbed.exec(n1, ["ip", "link", "set", f"{MGMT}p", "up"])
        testbed.exec(n1, ["ip", "link", "set", MGMT, "up"])
        yield {n1.name: DATA_ADDRESSES[0], n2.name: DATA_ADDRESSES[1]}
    finally:
        # deleting one end of a veth pair deletes the other
        testbed.exec(n1, ["ip", "link", "del", DATA], check=False)
        testbed.exec(n2, ["ip", "link", "del", "nbtpkd2"], check=False)
        testbed.exec(n1, ["ip", "link", "del", MGMT], check=False)


def _ssh_picker(
    testbed: Testbed, hosts: str, ssh_args: list[str] | None = None
) -> pk.ClusterPicker:
    p = pk.ClusterPicker(probe_max_bytes=1024)
    p.launcher.value = "ssh"
    p.hosts.value = hosts
    p.python.value = testbed.remote_python
    p.ssh_args.value = shlex.join(testbed.ssh_args if ssh_args is None else ssh_args)
    p.backend.value = "gloo"
    p.timeout.value = 90
    return p


def _values(p: pk.ClusterPicker) -> list[str]:
    return [v for _, v in p.iface.options]


def _label(p: pk.ClusterPicker, value: str) -> str:
    return next(label for label, v in p.iface.options if v == value)


def _assert_nodes_interfaces_offered(p: pk.ClusterPicker, testbed: Testbed) -> None:
    n2 = testbed.nodes[1]
    values = _values(p)
    # auto first, then what both nodes have, then node 1's own, saying which node lacks it
    assert values[0] == "auto"
    assert set(values[1:3]) == {DATA, "eth0"}, p.iface.options
    assert values[3:] == [MGMT], p.iface.options
    assert _label(p, DATA) == DATA and _label(p, MGMT) == f"{MGMT} (not on {n2.name})"
    # nothing of this machine's: its bridge to the nodes is not a node's interface
    assert testbed.bridge not in values and "lo" not in values
    info = p.iface_info.value
    for node, address in zip(testbed.nodes[:2], DATA_ADDRESSES):
        assert f"<td>{node.name}</td>" in info and f"{DATA} ({address})" in info
        assert f"eth0 ({node.address})" in info
    assert f"{MGMT}: not on {n2.name}" in info


def test_picker_starts_a_two_node_cluster_over_ssh(
    testbed: Testbed, extra_nics, tmp_path, monkeypatch
):
    monkeypatch.setenv("NBTRAIN_HOME", str(tmp_path))
    n1, n2 = testbed.nodes[0], testbed.nodes[1]
    before = _local_ipp_pids()
    p = _ssh_picker(testbed, f"{n1.name}:1,{n2.name}:1")
    # SSH hosts not checked yet: only auto, none of this machine's interfaces
    assert _values(p) == ["auto"]
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
        # auto: the interface that routes to rank 0, eth0 on both
        assert [r.interface for r in cluster.ranks] == ["eth0", "eth0"]
        # preflight ran on both nodes: the version table lists them, nothing highlighted
        assert 'class="nbtrain-preflight"' in p.versions.value
        assert n1.name in p.versions.value and n2.name in p.versions.value
        assert "nbtrain-odd" not in p.versions.value
        # and reported their interfaces: the dropdown now offers the nodes' interfaces
        _assert_nodes_interfaces_offered(p, testbed)
        assert "preflight" in p.iface_info.value and p.iface.value == "auto"
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


def _tx_bytes(testbed: Testbed, node, nic: str) -> int:
    out = testbed.exec(node, ["cat", f"/sys/class/net/{nic}/statistics/tx_bytes"]).stdout
    return int(out)


def test_check_hosts_offers_the_nodes_interfaces_and_a_start_on_one_uses_it(
    testbed: Testbed, extra_nics, tmp_path, monkeypatch
):
    monkeypatch.setenv("NBTRAIN_HOME", str(tmp_path))
    n1, n2 = testbed.nodes[0], testbed.nodes[1]
    before = _local_ipp_pids()
    p = _ssh_picker(testbed, f"{n1.name}:1,{n2.name}:1")
    p.check_button.click()
    p.wait(60)
    assert p.error.value == "", p.error.value
    assert p.status.value.startswith("checked 2 of 2 host(s)")
    assert "Check hosts" in p.iface_info.value
    _assert_nodes_interfaces_offered(p, testbed)
    assert set(p.node_interfaces()) == {n1.name, n2.name}
    # other hosts: the nodes' interfaces no longer apply
    p.hosts.value = f"{n1.name}:1"
    assert _values(p) == ["auto"]
    p.hosts.value = f"{n1.name}:1,{n2.name}:1"
    assert DATA in _values(p)

    p.iface.value = DATA
    p.start_button.click()
    p.wait(120)
    assert p.error.value == "", p.error.value
    cluster = p.cluster
    try:
        assert [r.interface for r in cluster.ranks] == [DATA, DATA]
        assert [r.address for r in cluster.ranks] == list(DATA_ADDRESSES)
        assert f"<td>{DATA}</td>" in p.topology.value
        assert p.iface.value == DATA  # the refresh from preflight keeps the choice

        def env():
            import os

            return [os.environ[k] for k in ("GLOO_SOCKET_IFNAME", "MASTER_ADDR")]

        assert cluster.run(env) == [[DATA, DATA_ADDRESSES[0]]] * 2

        def reduce():
            import torch
            import torch.distributed as dist

            t = torch.ones(2**20) * (dist.get_rank() + 1)
            dist.all_reduce(t)
            return float(t[0])

        sent = [_tx_bytes(testbed, n, DATA) for n in (n1, n2)]
        assert cluster.run(reduce) == [3.0, 3.0]
        # the 4 MiB all_reduce went over data0, not the nodes' eth0
        moved = [_tx_bytes(testbed, n, DATA) - s for n, s in zip((n1, n2), sent)]
        assert min(moved) > 2**21, moved
        assert pk.load_settings().iface == DATA
    finally:
        p.stop_button.click()
    assert cluster.stopped
    _assert_nothing_left(testbed, before)


def test_check_hosts_names_the_host_that_refuses_the_login(testbed: Testbed, extra_nics, tmp_path):
    n1, n2 = testbed.nodes[0], testbed.nodes[1]
    # node 1 with the test bed's key, node 2 with a key it does not know
    stranger = tmp_path / "stranger"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True)
    config = tmp_path / "ssh_config"
    config.write_text(
        f"Host {n1.name}\n    IdentityFile {testbed.ssh_key}\n"
        f"Host {n2.name}\n    IdentityFile {stranger}\n"
        "Host *\n    User root\n    IdentitiesOnly yes\n    BatchMode yes\n"
        f"    UserKnownHostsFile {Path(testbed.state_dir) / 'known_hosts'}\n"
        "    GlobalKnownHostsFile /dev/null\n    StrictHostKeyChecking yes\n    LogLevel ERROR\n"
    )
    p = _ssh_picker(testbed, f"{n1.name}:1,{n2.name}:1", ["-F", str(config)])
    p.check_button.click()
    p.wait(60)
    assert f"cannot log in to host {n2.name} over SSH" in p.error.value, p.error.value
    assert "Permission denied" in p.error.value and "ssh-copy-id" in p.error.value
    assert n1.name not in p.error.value.replace(n2.name, "")
    assert p.status.value.startswith("checked 1 of 2 host(s)")
    # node 1 answered: its interfaces are offered, mgmt0 included (the only node that answered)
    assert _values(p) == ["auto", DATA, "eth0", MGMT], p.iface.options
    assert p.cluster is None
