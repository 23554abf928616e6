"""nbtrain.cluster.probe's arithmetic and warnings (the timings themselves run in tests/multinode)."""

from __future__ import annotations

import pytest

from nbtrain.cluster.probe import bus_bandwidth, network_warnings, parse_size, sizes_up_to
from nbtrain.errors import ConfigError


def test_bus_bandwidth_is_nccl_tests_formula():
    # nccl-tests all_reduce: busbw = algbw * 2 (n - 1) / n
    algbw, busbw = bus_bandwidth(8e9, 2.0, 8)
    assert algbw == 4e9
    assert busbw == pytest.approx(4e9 * 2 * 7 / 8)
    assert bus_bandwidth(1e6, 1.0, 1) == (1e6, 1e6)


def test_sizes_and_parse_size():
    assert sizes_up_to(2**20) == [4, 4096, 16384, 65536, 262144, 1048576]
    assert sizes_up_to(100_000) == [4, 4096, 16384, 65536, 100_000]
    assert parse_size("64M") == 64 * 2**20 and parse_size("512k") == 512 * 1024
    assert parse_size("1GiB") == 2**30 and parse_size("100") == 100
    with pytest.raises(ConfigError, match="not a size"):
        parse_size("lots")


def _report(ib_state="4: ACTIVE", rate="200 Gb/sec (4X HDR)", speed=25000, env=None):
    ib = [
        {
            "device": "mlx5_0",
            "ports": [{"port": 1, "state": ib_state, "link_layer": "InfiniBand", "rate": rate}],
        }
    ]
    return {
        "interfaces": {"eth0": {"addresses": ["10.0.0.1"], "speed_mbps": speed}},
        "infiniband": ib if ib_state else [],
        "env": env or {},
    }


def test_warns_on_socket_fallback_where_infiniband_exists():
    reports = [_report(), _report()]
    hosts, nics = ["a", "b"], ["eth0", "eth0"]
    # 2 GB/s on NCCL with a 200 Gb/s HCA: the silent TCP fallback
    warn, nominal = network_warnings(reports, nics, hosts, "nccl", 2e9)
    assert any("fell back" in w and "mlx5_0" in w and "NCCL_DEBUG=INFO" in w for w in warn)
    assert nominal == pytest.approx(25000 * 1e6 / 8)
    # near the HCA's rate: no warning
    assert network_warnings(reports, nics, hosts, "nccl", 20e9)[0] == []
    # told to use sockets
    told = [_report(env={"NCCL_IB_DISABLE": "1"})] * 2
    assert any(
        "told to use sockets" in w for w in network_warnings(told, nics, hosts, "nccl", 20e9)[0]
    )
    # gloo never uses IB
    assert any(
        "gloo backend runs over TCP" in w
        for w in network_warnings(reports, nics, hosts, "gloo", 3e9)[0]
    )


def test_warns_when_far_below_the_link_speed_only_across_nodes():
    reports = [_report(ib_state=None, speed=10000)] * 2
    warn, _ = network_warnings(reports, ["eth0", "eth0"], ["a", "b"], "gloo", 0.1e9)
    assert any("far below the link's nominal 1.25 GB/s" in w for w in warn)
    assert network_warnings(reports, ["eth0", "eth0"], ["a", "b"], "gloo", 1.0e9)[0] == []
    # one node: no link between ranks to compare with
    assert network_warnings(reports, ["lo", "lo"], ["a", "a"], "gloo", 0.1e9) == ([], None)
