"""nbtrain.net across simulated nodes: the routes and addresses a real cluster would see."""

from __future__ import annotations

import json
import shlex

import pytest

from nbtrain import net

from .testbed import REPO, Testbed


def _on_node(tb: Testbed, node: str, code: str) -> dict:
    """Run `code` (which prints JSON) on `node` over ssh, importing nbtrain from this checkout."""
    cmd = f"cd {shlex.quote(str(REPO))} && {tb.remote_python} -c {shlex.quote(code)}"
    return json.loads(tb.ssh(node, cmd).stdout)


def test_head_routes_to_nodes_through_the_bridge(testbed: Testbed) -> None:
    for node in testbed.nodes:
        r = net.route_to(node.name)
        assert (r.address, r.source, r.interface, r.local) == (
            node.address,
            testbed.head_address,
            testbed.bridge,
            False,
        )


def test_controller_listens_on_the_bridge_address_when_a_host_is_remote(testbed: Testbed) -> None:
    choice = net.listen_address(testbed.names)
    assert (choice.address, choice.interface) == (testbed.head_address, testbed.bridge)
    # a local host among remote ones does not pull it back to loopback
    mixed = net.listen_address(["localhost", testbed.nodes[0].name])
    assert mixed.address == testbed.head_address
    assert net.listen_address(["localhost"]).address == "127.0.0.1"


CODE = """
import json, sys
from nbtrain import net
peers = sys.argv[1:]
routes = {p: net.route_to(p) for p in peers}
try:
    net.route_to("203.0.113.9")  # nodes have no default route
    unreachable = None
except net.UnreachableHostError as e:
    unreachable = str(e)
print(json.dumps({
    "interfaces": {i.name: list(i.ipv4) for i in net.interfaces()},
    "routes": {p: [r.source, r.interface, r.local] for p, r in routes.items()},
    "listen": net.listen_address(peers).address,
    "unreachable": unreachable,
}))
"""


@pytest.mark.parametrize("index", [0, 1])
def test_a_node_sees_its_own_interface_and_routes(testbed: Testbed, index: int) -> None:
    node = testbed.nodes[index]
    peers = [testbed.head_name] + [n.name for n in testbed.nodes if n != node]
    code = f"import sys; sys.argv[1:] = {peers!r}\n" + CODE
    got = _on_node(testbed, node.name, code)
    assert got["interfaces"][node.iface] == [node.address]
    assert set(got["interfaces"]) == {node.iface, "lo"}
    for peer in peers:
        assert got["routes"][peer] == [node.address, node.iface, False]
    assert got["listen"] == node.address
    assert got["unreachable"] is not None and "203.0.113.9" in got["unreachable"]
    assert "--ip" in got["unreachable"]
