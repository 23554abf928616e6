"""nbtrain.ClusterPicker: settings, validation, and the widget driven like a user (real local engines)."""

from __future__ import annotations

import json
import time

import pytest

import nbtrain
from nbtrain.display import picker as pk
from nbtrain.errors import ConfigError

# the test Slurm of tests/cluster/launch/test_slurm.py (module-scoped; skips, saying why, where it cannot start)
from tests.cluster.launch.test_slurm import _assert_job_gone, _squeue, slurm_bed  # noqa: F401
from tests.conftest import cluster_processes, wait_gone

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("NBTRAIN_HOME", str(tmp_path))
    return tmp_path


# -- settings --------------------------------------------------------------------------------------


def test_settings_round_trip(home):
    assert pk.settings_path() == home / "picker.json"
    assert pk.load_settings() == pk.PickerSettings()  # nothing saved yet: the defaults
    s = pk.PickerSettings(
        launcher="ssh",
        hosts="node1:2,node2:1",
        backend="gloo",
        iface="eth0",
        ip="10.0.0.5",
        port=29555,
        timeout=30.0,
        allow_version_mismatch=True,
    )
    path = pk.save_settings(s)
    assert path == home / "picker.json"
    assert json.loads(path.read_text())["hosts"] == "node1:2,node2:1"
    assert pk.load_settings() == s


def test_settings_default_path_without_home(monkeypatch, tmp_path):
    monkeypatch.delenv("NBTRAIN_HOME", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert pk.settings_path() == tmp_path / "nbtrain" / "picker.json"


def test_unreadable_or_foreign_settings_fall_back(home):
    (home / "picker.json").write_text("{not json")
    assert pk.load_settings() == pk.PickerSettings()
    # a key from another nbtrain version is ignored, the rest kept
    (home / "picker.json").write_text(json.dumps({"n": 3, "from_the_future": 1}))
    assert pk.load_settings() == pk.PickerSettings(n=3)


def test_widget_restores_saved_settings(home):
    pk.save_settings(pk.PickerSettings(launcher="ssh", hosts="a:1,b:2", port=29600, backend="gloo"))
    p = pk.ClusterPicker()
    assert p.launcher.value == "ssh"
    assert p.hosts.value == "a:1,b:2"
    assert p.port.value == "29600"
    assert p.backend.value == "gloo"
    assert p.settings() == pk.load_settings()


# -- validation ------------------------------------------------------------------------------------


def test_validation_messages():
    assert pk.validate(pk.PickerSettings()) == {}
    assert pk.validate(pk.PickerSettings(launcher="ssh", hosts="node1:2,node2:2")) == {}
    errs = pk.validate(pk.PickerSettings(launcher="ssh", hosts="node1:2,,node2"))
    assert "entry 2 is empty" in errs["hosts"]
    errs = pk.validate(pk.PickerSettings(launcher="ssh", hosts="node1:2,node1:1"))
    assert "listed twice" in errs["hosts"]
    errs = pk.validate(pk.PickerSettings(launcher="ssh", hosts=""))
    assert "--hosts is empty" in errs["hosts"]
    errs = pk.validate(pk.PickerSettings(launcher="ssh", hosts="n1", port=70000))
    assert "70000 is not a TCP port" in errs["port"]
    errs = pk.validate(pk.PickerSettings(launcher="ssh", hosts="n1", port="29x"))
    assert "29x is not a TCP port" in errs["port"]
    errs = pk.validate(pk.PickerSettings(n=0))
    assert "at least one engine" in errs["n"]
    # hosts are only checked for the SSH launcher
    assert pk.validate(pk.PickerSettings(launcher="local", hosts=",,")) == {}


def test_api_call_matches_the_magics():
    name, kw = pk.api_call(pk.PickerSettings(n=2, backend="gloo", timeout=30))
    assert (name, kw) == ("start", {"n": 2, "backend": "gloo", "timeout": 30, "force": False})
    name, kw = pk.api_call(
        pk.PickerSettings(launcher="ssh", hosts="n1:2", iface="auto", port=29500)
    )
    assert name == "start"
    assert kw["launcher"] == "ssh" and kw["hosts"] == "n1:2"
    assert kw["iface"] is None and kw["ip"] is None and kw["port"] == 29500
    assert "remote_python" not in kw and "ssh_args" not in kw  # LaunchOptions' defaults apply
    _, kw = pk.api_call(
        pk.PickerSettings(launcher="ssh", hosts="n1", python="/opt/py/bin/python", ssh_args="-F c")
    )
    assert kw["remote_python"] == "/opt/py/bin/python" and kw["ssh_args"] == "-F c"
    name, kw = pk.api_call(pk.PickerSettings(launcher="connect", profile="mpi", iface="eth1"))
    assert name == "connect"
    assert kw["profile"] == "mpi" and kw["cluster_id"] is None and kw["iface"] == "eth1"


def test_start_cluster_refuses_invalid_settings_before_starting():
    before = nbtrain.current_cluster()
    with pytest.raises(ConfigError, match="entry 2 is empty"):
        pk.start_cluster(pk.PickerSettings(launcher="ssh", hosts="a,,b"))
    assert nbtrain.current_cluster() is before


def test_widget_shows_hosts_error_inline(home):
    p = pk.ClusterPicker(remember=False)
    p.launcher.value = "ssh"
    p.hosts.value = "node1:two"
    assert "node1:two" in p.error.value and "Traceback" not in p.error.value
    p.hosts.value = "node1:2"
    assert p.error.value == ""
    # Start with bad settings shows the message and starts nothing
    p.hosts.value = "a,,b"
    p.start_button.click()
    assert "entry 2 is empty" in p.error.value
    assert p.cluster is None and not p.start_button.disabled


# -- the Slurm page (no Slurm needed: the settings, the call, the messages) -------------------------


def _slurm_page(p: pk.ClusterPicker) -> None:
    p.launcher.value = "slurm"
    p.nodes.value = 2
    p.gpus_per_node.value = "4"
    p.partition.value = "gpu"
    p.account.value = "proj"
    p.time.value = "02:00:00"
    p.backend.value = "nccl"
    p.timeout.value = 600


def test_slurm_page_builds_the_start_call(home):
    p = pk.ClusterPicker(remember=False)
    assert [v for _, v in p.launcher.options] == ["local", "ssh", "slurm", "ray", "connect"]
    _slurm_page(p)
    # only what was filled in: sbatch lines, engines per node, python, ip, interface, port are not
    assert pk.api_call(p.settings()) == (
        "start",
        {
            "launcher": "slurm",
            "nodes": 2,
            "gpus_per_node": 4,
            "partition": "gpu",
            "account": "proj",
            "time": "02:00:00",
            "backend": "nccl",
            "timeout": 600.0,
            "force": False,
        },
    )
    p.engines_per_node.value = "2"
    p.slurm_args.value = "--qos=high\n--constraint=a100"
    p.python.value = "/opt/env/bin/python"
    p.port.value = "29555"
    p.allow_mismatch.value = True
    _, kw = pk.api_call(p.settings(), force=True)
    assert kw["engines_per_node"] == 2 and kw["slurm_args"] == "--qos=high\n--constraint=a100"
    assert kw["remote_python"] == "/opt/env/bin/python" and kw["port"] == 29555
    assert kw["allow_version_mismatch"] is True and kw["force"] is True
    assert "iface" not in kw and "ip" not in kw and "hosts" not in kw
    # the call is one nbtrain.start takes: LaunchOptions reads the sbatch lines as the magic does
    from nbtrain.cluster.launch import parse_launch, slurm

    launch = {k: v for k, v in kw.items() if k not in ("launcher", "backend", "timeout", "force")}
    script = slurm.batch_script(parse_launch("slurm", launch))
    assert "#SBATCH --qos=high\n#SBATCH --constraint=a100\n" in script
    assert "#SBATCH --ntasks-per-node=2\n" in script and "#SBATCH --gpus-per-node=4\n" in script


def test_slurm_page_is_remembered_and_restored(home):
    p = pk.ClusterPicker()
    _slurm_page(p)
    p.slurm_args.value = "--qos=high"
    pk.save_settings(p.settings())
    q = pk.ClusterPicker()
    assert q.launcher.value == "slurm"
    assert (q.nodes.value, q.gpus_per_node.value, q.engines_per_node.value) == (2, "4", "")
    assert (q.partition.value, q.account.value, q.time.value) == ("gpu", "proj", "02:00:00")
    assert q.slurm_args.value == "--qos=high" and q.backend.value == "nccl"
    assert q.settings() == p.settings()
    # the Slurm fields sit on the Slurm page only
    assert q._slurm_box.layout.display == "" and q._ssh_box.layout.display == "none"
    assert q._engines_remote.layout.display == ""
    q.launcher.value = "ssh"
    assert q._slurm_box.layout.display == "none" and q._engines_remote.layout.display == ""


def test_settings_saved_before_the_slurm_page_still_load(home):
    # a picker.json as nbtrain wrote it before the Slurm page: no Slurm keys
    old = {
        "launcher": "ssh",
        "n": 1,
        "hosts": "node1:2,node2:2",
        "backend": "gloo",
        "iface": "eth1",
        "ip": "",
        "port": 29500,
        "profile": "",
        "cluster_id": "",
        "timeout": 60.0,
        "allow_version_mismatch": False,
        "python": "/opt/py/bin/python",
        "ssh_args": "-F cfg",
    }
    (home / "picker.json").write_text(json.dumps(old))
    s = pk.load_settings()
    assert s == pk.PickerSettings(**old)
    assert (s.nodes, s.gpus_per_node, s.time, s.slurm_args) == (1, None, "", "")
    p = pk.ClusterPicker()
    assert p.launcher.value == "ssh" and p.hosts.value == "node1:2,node2:2"
    assert p.iface.value == "eth1" and p.python.value == "/opt/py/bin/python"


def test_slurm_bad_time_is_shown_as_typed_and_start_refuses(home):
    p = pk.ClusterPicker(remember=False)
    _slurm_page(p)
    assert p.error.value == "", p.error.value
    p.time.value = "2h"
    assert "--time &#x27;2h&#x27; is not a Slurm time limit" in p.error.value
    assert "02:00:00" in p.error.value and "Traceback" not in p.error.value
    p.start_button.click()  # refused before anything is submitted
    assert p.cluster is None and not p.start_button.disabled
    assert "is not a Slurm time limit" in p.error.value
    with pytest.raises(ConfigError, match="--time '2h' is not a Slurm time limit"):
        pk.start_cluster(p.settings())
    p.time.value = "90"
    assert p.error.value == ""
    # the other settings as LaunchOptions checks them, as they are typed
    p.engines_per_node.value = "8"
    assert "--engines-per-node 8 is more than --gpus-per-node 4" in p.error.value
    p.engines_per_node.value = ""
    p.partition.value = "gpu nodes"
    assert "--partition &#x27;gpu nodes&#x27; is not a Slurm name" in p.error.value
    p.partition.value = "gpu"
    p.nodes.value = 0
    assert "--nodes 0 is not a whole number at least 1" in p.error.value


def test_slurm_page_without_slurm_here_says_so(home, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch, squeue, scancel
    p = pk.ClusterPicker(remember=False)
    p.launcher.value = "slurm"  # said at once, before Start
    assert "sbatch, squeue, scancel are not on PATH" in p.error.value
    assert "login node" in p.error.value
    p.start_button.click()
    assert p.cluster is None and "not on PATH" in p.error.value
    p.launcher.value = "local"
    assert p.error.value == ""


def test_interface_choices_are_this_machines():
    from nbtrain import net

    choices = pk.interface_choices()
    assert choices[0] == "auto"
    assert set(choices[1:]) == {i.name for i in net.interfaces()}


# -- the nodes' interfaces ------------------------------------------------------------------------

NODES = {
    "node1": {
        "data0": ["10.9.0.1", "fe80::1"],
        "eth0": ["192.168.1.11"],
        "lo": ["127.0.0.1", "::1"],
        "mgmt0": ["172.16.0.11"],
        "v6only": ["fd00::11"],
    },
    "node2": {
        "data0": ["10.9.0.2"],
        "eth0": ["192.168.1.12"],
        "lo": ["127.0.0.1", "::1"],
        "v6only": ["fd00::12"],
        "ib0": [],
    },
}


def test_node_interface_options_common_first_then_who_lacks_what():
    opts = pk.node_interface_options(NODES)
    assert opts == [
        ("auto", "auto"),
        ("data0", "data0"),
        ("eth0", "eth0"),
        ("mgmt0 (not on node2)", "mgmt0"),
    ]
    # one node: its loopback is a choice (last, in the node's order); a second node's lack of an
    # IPv4 address is named
    assert [v for _, v in pk.node_interface_options({"node1": NODES["node1"]})] == [
        "auto",
        "data0",
        "eth0",
        "lo",
        "mgmt0",
    ]
    # ... unless the other hosts just did not answer: loopback still connects nothing
    assert "lo" not in [
        v for _, v in pk.node_interface_options({"node1": NODES["node1"]}, n_hosts=2)
    ]
    odd = {"a": {"eth1": ["10.0.0.1"]}, "b": {"eth1": ["fd00::2"]}}
    assert pk.node_interface_options(odd)[1] == ("eth1 (no IPv4 address on b)", "eth1")
    # a saved choice the nodes do not have stays, and says so
    assert pk.node_interface_options(NODES, "ib9")[-1] == ("ib9 (not on node1, node2)", "ib9")
    assert pk.node_interface_options({}, "ib9")[-1] == ("ib9 (not found on the nodes)", "ib9")


def test_node_interfaces_html_lists_every_node_and_what_is_missing():
    text = pk.node_interfaces_html(NODES, "Check hosts")
    assert "<td>node1</td><td>data0 (10.9.0.1), eth0 (192.168.1.11), lo (127.0.0.1), " in text
    assert "mgmt0: not on node2" in text
    assert "fe80" not in text and "ib0" not in text
    assert pk.node_interfaces_html({}, "x") == ""


def test_interfaces_from_preflight_reports_one_per_host():
    from types import SimpleNamespace as NS

    ranks = [NS(host="node1"), NS(host="node2"), NS(host="node2")]
    reports = [
        {"interfaces": {"eth0": {"addresses": ["10.0.0.1"], "up": True}}},
        {"interfaces": {"eth0": {"addresses": ["10.0.0.2"], "up": True}}},
        {"interfaces": {"other": {"addresses": ["10.0.0.3"], "up": True}}},  # same host: ignored
    ]
    assert pk.interfaces_from_reports(ranks, reports) == {
        "node1": {"eth0": ["10.0.0.1"]},
        "node2": {"eth0": ["10.0.0.2"]},
    }


def test_ssh_dropdown_offers_auto_and_the_saved_choice_until_hosts_are_checked(home):
    from nbtrain import net

    pk.save_settings(pk.PickerSettings(launcher="ssh", hosts="a:1,b:1", iface="ib0"))
    p = pk.ClusterPicker()
    # this machine's interfaces say nothing about the hosts': not offered for SSH hosts
    assert [v for _, v in p.iface.options] == ["auto", "ib0"] and p.iface.value == "ib0"
    assert "Check hosts" in p.iface_info.value
    # this machine, or an existing cluster before it is connected: this machine's interfaces
    p.launcher.value = "connect"
    assert {v for _, v in p.iface.options} == {"auto", "ib0", *(i.name for i in net.interfaces())}
    assert p.iface.value == "ib0"


def test_check_hosts_names_the_host_it_cannot_reach(home):
    p = pk.ClusterPicker(remember=False)
    p.launcher.value = "ssh"
    p.hosts.value = "nbtrain-no-such-host.invalid:1"
    p.check_button.click()
    p.wait(60)
    assert "nbtrain-no-such-host.invalid" in p.error.value, p.error.value
    assert "cannot resolve host" in p.error.value and "Traceback" not in p.error.value
    assert p.status.value.startswith("checked 0 of 1 host(s)")
    assert not p.check_button.disabled and not p.start_button.disabled
    assert p.node_interfaces() is None and [v for _, v in p.iface.options] == ["auto"]
    # invalid hosts are refused before anything logs in
    p.hosts.value = "a,,b"
    p.check_button.click()
    assert "entry 2 is empty" in p.error.value


# -- the widget on a real cluster ------------------------------------------------------------------


def test_picker_starts_probes_and_stops_a_local_cluster(home):
    # the picker, like %nbtrain start without --force, refuses to replace a cluster it did not start
    assert nbtrain.current_cluster() is None, "a cluster from an earlier test is still running"
    p = pk.ClusterPicker(probe_max_bytes=1024)
    p.launcher.value = "local"
    p.n.value = 1
    p.backend.value = "gloo"
    p.timeout.value = 90
    p.start_button.click()
    # the button stays disabled while the cluster starts; the status shows the elapsed seconds
    assert p.start_button.disabled
    assert p.status.value.startswith("starting...") and p.status.value.endswith(" s")
    p.wait(100)
    assert p.error.value == "", p.error.value
    cluster = p.cluster
    assert cluster is not None and nbtrain.current_cluster() is cluster
    try:
        assert cluster.world_size == 1
        assert "ready: 1 rank(s)" in p.status.value
        assert not p.start_button.disabled and not p.stop_button.disabled
        r0 = cluster.ranks[0]
        assert "<td>0</td>" in p.topology.value
        assert (
            f"<td>{r0.host}</td>" in p.topology.value
            and f"<td>{r0.device}</td>" in p.topology.value
        )
        # the settings that started it were remembered
        assert pk.load_settings() == p.settings()

        p.probe_button.click()
        p.wait(60)
        assert p.error.value == "", p.error.value
        assert "all_reduce across 1 rank(s), backend gloo" in p.probe_out.value
        assert "1 KiB" in p.probe_out.value
    finally:
        pids = list(cluster._pids)
        cid = cluster.cluster_id
        p.stop_button.click()
    assert cluster.stopped and nbtrain.current_cluster() is None
    assert p.status.value == "stopped" and p.topology.value == ""
    assert p.stop_button.disabled and p.probe_button.disabled
    assert wait_gone(pids) == []
    deadline = time.monotonic() + 10
    while cluster_processes(cid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert cluster_processes(cid) == []


def test_picker_shows_the_cluster_already_running_and_lines_up_its_checkbox(home):
    assert nbtrain.current_cluster() is None, "a cluster from an earlier test is still running"
    cluster = nbtrain.start(n=2, backend="gloo", timeout=90)
    pids, cid = list(cluster._pids), cluster.cluster_id
    try:
        p = pk.ClusterPicker(remember=False, background=False)
        # the form is the running cluster's, not last time's settings (Engines 1, Start enabled)
        assert p.cluster is cluster
        assert p.launcher.value == "local" and p.n.value == 2 and p.backend.value == "gloo"
        assert p.start_button.disabled
        assert not p.stop_button.disabled and not p.probe_button.disabled
        assert p.status.value.startswith("running: 2 rank(s) on 1 host(s), backend gloo")
        assert p.topology.value.count("<tr>") == 1 + 2  # the head and one row per rank
        # the version-mismatch box sits under the fields: indented by their label width
        label = p.allow_mismatch.style.description_width
        assert p.allow_mismatch.indent and label == p.port.style.description_width == "150px"
        p.stop_button.click()
    finally:
        if not cluster.stopped:
            cluster.stop()
    assert nbtrain.current_cluster() is None and p.status.value == "stopped"
    assert not p.start_button.disabled and p.stop_button.disabled
    assert wait_gone(pids) == []
    deadline = time.monotonic() + 10
    while cluster_processes(cid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert cluster_processes(cid) == []
    # with no cluster running, a new picker leaves Start enabled
    assert not pk.ClusterPicker(remember=False).start_button.disabled


def test_failed_start_shows_the_message_not_a_traceback(home):
    before = nbtrain.current_cluster()
    p = pk.ClusterPicker(remember=False)
    p.launcher.value = "connect"
    p.profile.value = "nbtrain-picker-no-such-profile"
    p.timeout.value = 5
    p.start_button.click()
    p.wait(30)
    assert p.cluster is None and nbtrain.current_cluster() is before
    assert "nbtrain-picker-no-such-profile" in p.error.value, p.error.value
    assert "Traceback" not in p.error.value
    assert p.status.value.startswith("failed after")
    assert not p.start_button.disabled and p.stop_button.disabled


# -- the Slurm page on a real single-machine Slurm (scripts/slurm-testbed.sh) ----------------------


@pytest.mark.slurm
@pytest.mark.usefixtures("slurm_bed")
def test_picker_starts_a_slurm_job_shows_the_ranks_and_stops_it(home):
    import re
    import socket

    assert nbtrain.current_cluster() is None, "a cluster from an earlier test is still running"
    p = pk.ClusterPicker(probe_max_bytes=1024)
    p.launcher.value = "slurm"
    p.nodes.value = 1
    p.engines_per_node.value = "2"
    p.time.value = "10"
    p.backend.value = "gloo"
    p.timeout.value = 90
    assert p.error.value == "", p.error.value
    t0 = time.monotonic()
    p.start_button.click()
    assert p.start_button.disabled and p.status.value.startswith("starting...")
    p.wait(100)
    started = time.monotonic() - t0
    assert p.error.value == "", p.error.value
    cluster = p.cluster
    assert cluster is not None and nbtrain.current_cluster() is cluster
    job = next((m for n in cluster.notes if (m := re.match(r"slurm job (\d+) running", n))), None)
    assert job, cluster.notes
    job_id = job.group(1)
    try:
        assert "ready: 2 rank(s) on 1 host(s), backend gloo" in p.status.value
        host = socket.gethostname()
        for rank in (0, 1):
            device = cluster.ranks[rank].device  # cpu, or the rank's own GPU (explicit gloo)
            assert f"<tr><td>{rank}</td><td>{host}</td><td>{rank}</td><td>{device}</td>" in (
                p.topology.value
            ), p.topology.value
        assert p.topology.value.count("<tr><td>") == 2
        assert f"{job_id} RUNNING" in _squeue(job_id)
        # the version table of the nodes (preflight ran on the job's engines)
        assert "nbtrain" in p.versions.value and "torch" in p.versions.value
        assert pk.load_settings() == p.settings()  # remembered
        p.probe_button.click()
        p.wait(60)
        assert "all_reduce across 2 rank(s), backend gloo" in p.probe_out.value, p.error.value
    finally:
        t1 = time.monotonic()
        p.stop_button.click()
    print(f"picker slurm start {started:.1f} s, stop {time.monotonic() - t1:.1f} s")
    assert cluster.stopped and nbtrain.current_cluster() is None and p.status.value == "stopped"
    _assert_job_gone(job_id, cluster.cluster_id)


@pytest.mark.slurm
@pytest.mark.usefixtures("slurm_bed")
def test_picker_shows_the_pending_job_then_the_timeout(home):
    # two nodes on a one-node Slurm: the job stays pending (PartitionNodeLimit) until the timeout
    p = pk.ClusterPicker(remember=False)
    p.launcher.value = "slurm"
    p.nodes.value = 2
    p.timeout.value = 6
    seen: list[str] = []
    p.status.observe(lambda change: seen.append(change["new"]), names="value")
    p.start_button.click()
    p.wait(30)
    pending = [s for s in seen if "pending (PartitionNodeLimit)" in s]
    assert pending, seen
    job_id = pending[0].split("slurm job ")[1].split()[0]
    assert pending[0].startswith("starting... ")
    assert f"slurm job {job_id} was still pending after --timeout 6 s" in p.error.value
    assert "Traceback" not in p.error.value and p.status.value.startswith("failed after")
    assert p.cluster is None and not p.start_button.disabled
    assert _squeue(job_id) == ""
