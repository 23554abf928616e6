"""Preflight: the real collect() of this machine, and compare() over copies altered as other nodes."""

from __future__ import annotations

import copy
import importlib.metadata
import json
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

import nbtrain
from nbtrain.cluster.launch.preflight import (
    ALLOW_FLAG,
    VersionMismatchError,
    compare,
    format_html,
    format_table,
)
from nbtrain.engine.preflight import INFINIBAND_SYSFS, collect, infiniband_devices

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    return collect()


def node(report: dict[str, Any], host: str, **changes: Any) -> dict[str, Any]:
    """This machine's real report as another node with `changes` (what that node would report)."""
    r = copy.deepcopy(report)
    r["hostname"] = host
    r.update(changes)
    return r


# -- collect ---------------------------------------------------------------------------------------


def test_collect_reports_this_machine(report: dict[str, Any]) -> None:
    assert report["hostname"] == socket.gethostname()
    assert report["python"] == platform.python_version()
    assert report["python_executable"] == sys.executable
    assert report["torch"] == torch.__version__
    assert report["cuda"] == {"version": torch.version.cuda, "available": torch.cuda.is_available()}
    assert len(report["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert report["nbtrain"] == nbtrain.__version__
    for dist in ("transformers", "peft"):
        assert report[dist] == importlib.metadata.version(dist)
    if not torch.distributed.is_nccl_available():
        assert report["nccl"] is None
    else:
        assert report["nccl"].count(".") == 2
    # it travels from engines to the client
    assert json.loads(json.dumps(report)) == report


def test_collect_lists_interfaces_with_addresses(report: dict[str, Any]) -> None:
    ifaces = report["interfaces"]
    assert set(ifaces) == set(psutil.net_if_addrs())
    loopback = [n for n, i in ifaces.items() if "127.0.0.1" in i["addresses"]]
    assert len(loopback) == 1 and ifaces[loopback[0]]["up"]
    for name, info in ifaces.items():
        v4 = [a.address for a in psutil.net_if_addrs()[name] if a.family == socket.AF_INET]
        assert info["addresses"][: len(v4)] == v4


def test_collect_reports_infiniband_devices_present(report: dict[str, Any]) -> None:
    present = (
        sorted(p.name for p in INFINIBAND_SYSFS.iterdir()) if INFINIBAND_SYSFS.is_dir() else []
    )
    assert [d["device"] for d in report["infiniband"]] == present


def test_infiniband_devices_read_port_state_link_layer_and_rate(tmp_path: Path) -> None:
    # the sysfs layout of a ConnectX card with one IB port and one RoCE device
    layout = {
        "mlx5_0/ports/1": ("4: ACTIVE", "InfiniBand", "200 Gb/sec (4X HDR)"),
        "mlx5_1/ports/1": ("1: DOWN", "Ethernet", "100 Gb/sec (4X EDR)"),
    }
    for port, (state, layer, rate) in layout.items():
        d = tmp_path / port
        d.mkdir(parents=True)
        (d / "state").write_text(state + "\n")
        (d / "link_layer").write_text(layer + "\n")
        (d / "rate").write_text(rate + "\n")
    devices = infiniband_devices(tmp_path)
    assert devices == [
        {
            "device": "mlx5_0",
            "ports": [
                {
                    "port": 1,
                    "state": "4: ACTIVE",
                    "link_layer": "InfiniBand",
                    "rate": layout["mlx5_0/ports/1"][2],
                }
            ],
        },
        {
            "device": "mlx5_1",
            "ports": [
                {
                    "port": 1,
                    "state": "1: DOWN",
                    "link_layer": "Ethernet",
                    "rate": "100 Gb/sec (4X EDR)",
                }
            ],
        },
    ]
    assert infiniband_devices(tmp_path / "absent") == []


def test_importing_preflight_modules_does_not_import_torch() -> None:
    code = (
        "import sys, nbtrain.engine.preflight, nbtrain.cluster.launch.preflight, nbtrain.net; "
        "print(sorted(m for m in ('torch', 'transformers', 'IPython') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


# -- compare ---------------------------------------------------------------------------------------


def test_identical_nodes_pass_and_engines_of_one_host_count_once(report: dict[str, Any]) -> None:
    reports = [report, report, node(report, "node2"), node(report, "node2")]
    result = compare(reports)
    assert result.mismatches == [] and result.ok and result.odd_nodes == []
    assert list(result.reports) == [report["hostname"], "node2"]
    assert result.engines == {report["hostname"]: 2, "node2": 2}
    result.raise_if_fatal()
    assert result.message() == ""
    table = format_table(result)
    assert all(line.startswith("  ") for line in table.splitlines())
    assert "*" not in table


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("torch", "2.1.0+cu121"),
        ("nccl", "2.18.1"),
        ("nbtrain", "0.0.9"),
        ("python", "3.9.18"),
    ],
)
def test_fatal_mismatch_refuses_and_names_the_odd_node(
    report: dict[str, Any], key: str, value: str
) -> None:
    reports = [report, node(report, "node2"), node(report, "node3", **{key: value})]
    result = compare(reports)
    assert not result.ok
    assert result.odd_nodes == ["node3"]
    [m] = result.fatal
    compared = "3.9" if key == "python" else value  # Python compares major.minor
    assert m.key == key and m.odd == {"node3": compared}
    assert m.expected_on == (report["hostname"], "node2")
    with pytest.raises(VersionMismatchError) as e:
        result.raise_if_fatal()
    msg = str(e.value)
    assert "node3" in msg and value in msg and ALLOW_FLAG in msg and "refusing" in msg
    assert e.value.result is result
    # the table in the error marks the odd row and the odd value, and nothing else
    rows = {line[2:].split()[0]: line for line in msg.splitlines() if line[2:].strip()}
    assert rows["node3"].startswith("!")
    assert f"*{value}" in rows["node3"]
    assert not rows["node2"].startswith("!") and "*" not in rows["node2"]


def test_fatal_mismatch_is_allowed_with_the_flag(report: dict[str, Any]) -> None:
    reports = [report, node(report, "node2", torch="2.1.0")]
    result = compare(reports, allow_version_mismatch=True)
    assert result.ok and result.fatal
    result.raise_if_fatal()
    assert "starting anyway" in result.message()


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("transformers", "4.45.0"),
        ("peft", "0.13.0"),
        ("cuda", {"version": "12.1", "available": True}),
    ],
)
def test_transformers_peft_and_cuda_mismatch_only_warn(
    report: dict[str, Any], key: str, value: Any
) -> None:
    reports = [report, node(report, "node2"), node(report, "node3", **{key: value})]
    result = compare(reports)
    assert result.ok and not result.fatal
    [m] = result.warnings
    assert m.key == key and list(m.odd) == ["node3"]
    result.raise_if_fatal()
    msg = result.message()
    assert msg.startswith("Warning") and "node3" in msg
    odd = [line for line in format_table(result).splitlines() if "node3" in line]
    assert odd[0].startswith("?") and "~" in odd[0]


def test_python_patch_releases_do_not_differ(report: dict[str, Any]) -> None:
    major, minor, *_ = report["python"].split(".")
    result = compare([report, node(report, "node2", python=f"{major}.{minor}.99")])
    assert result.mismatches == []


def test_a_missing_torch_is_a_mismatch(report: dict[str, Any]) -> None:
    result = compare([report, node(report, "node2", torch=None)])
    [m] = result.fatal
    assert m.odd == {"node2": None}
    assert "missing on node2" in result.message()


def test_a_tie_counts_the_first_node_as_expected(report: dict[str, Any]) -> None:
    result = compare([node(report, "node1"), node(report, "node2", nbtrain="9.9.9")])
    [m] = result.fatal
    assert (m.expected, m.odd) == (nbtrain.__version__, {"node2": "9.9.9"})
    assert f"pip install nbtrain=={nbtrain.__version__} on node2" in result.message()


def test_engines_of_one_host_that_disagree_are_shown_apart(report: dict[str, Any]) -> None:
    reports = [node(report, "node1"), node(report, "node1"), node(report, "node1", torch="2.0.0")]
    result = compare(reports)
    assert list(result.reports) == ["node1", "node1 (engine 2)"]
    assert result.odd_nodes == ["node1 (engine 2)"]


def test_table_columns_line_up(report: dict[str, Any]) -> None:
    result = compare([report, node(report, "a-much-longer-node-name", torch="2.0.0")])
    lines = format_table(result).splitlines()
    col = lines[0].index("torch")
    for line in lines[1:3]:
        assert line[col - 1] == " " and line[col] != " "


def test_html_table_highlights_the_odd_value_and_escapes(report: dict[str, Any]) -> None:
    result = compare([report, node(report, "<node2>", nccl="2.18.1", peft="0.1.0")])
    page = format_html(result)
    assert page.startswith('<table class="nbtrain-preflight">') and page.endswith("</table>")
    assert "&lt;node2&gt;" in page and "<node2>" not in page
    assert 'class="nbtrain-odd"' in page
    assert "#f8d7da" in page and "#fff3cd" in page  # refuses (NCCL), warns (peft)
    assert ALLOW_FLAG in page
    assert result._repr_html_() == page
