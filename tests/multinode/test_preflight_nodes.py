"""Preflight on simulated nodes: each node reports its own host name and interface; they agree."""

from __future__ import annotations

import json
import shlex

from nbtrain.cluster.launch.preflight import compare, format_table
from nbtrain.engine.preflight import collect

from .testbed import REPO, Testbed

CODE = "import json; from nbtrain.engine.preflight import collect; print(json.dumps(collect()))"


def test_nodes_report_themselves_and_match_the_head(testbed: Testbed) -> None:
    reports = [collect()]
    for node in testbed.nodes:
        cmd = f"cd {shlex.quote(str(REPO))} && {testbed.remote_python} -c {shlex.quote(CODE)}"
        r = json.loads(testbed.ssh(node, cmd, timeout=60).stdout)
        assert r["hostname"] == node.name
        assert r["interfaces"][node.iface]["addresses"][0] == node.address
        assert set(r["interfaces"]) == {node.iface, "lo"}
        reports.append(r)
    result = compare(reports)
    assert result.mismatches == [] and result.ok
    assert list(result.reports) == [reports[0]["hostname"], *testbed.names]
    for name in testbed.names:
        assert name in format_table(result)
