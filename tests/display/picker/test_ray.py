"""The picker's Ray page (nbtrain/display/picker/ray.py): its fields, the messages as typed, the
call it makes and the settings it remembers. No Ray starts here: tests/cluster/launch/ray/test_ray.py starts real ones.

(A file of its own: tests/display/picker/test_picker.py is at the 500-line mark.)
"""

from __future__ import annotations

import json

import pytest

from nbtrain.cluster.launch import parse_launch
from nbtrain.cluster.launch.ray import PLACEMENTS
from nbtrain.display import picker as pk
from nbtrain.errors import ConfigError

pytestmark = pytest.mark.timeout(120)

# what LaunchOptions takes of a start call (the rest is StartOptions')
_START_ONLY = ("launcher", "n", "backend", "timeout", "force")


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("NBTRAIN_HOME", str(tmp_path))
    return tmp_path


def _ray_page(p: pk.ClusterPicker) -> None:
    p.launcher.value = "ray"
    p.address.value = "auto"
    p.ray_page.n.value = 4
    p.gpus_per_rank.value = "1"
    p.placement.value = "SPREAD"


def test_ray_page_fields_and_what_it_shows(home):
    p = pk.ClusterPicker(remember=False)
    assert ("Ray cluster", "ray") in p.launcher.options
    p.launcher.value = "ray"
    page = p.ray_page
    assert p.address.value == "auto" and page.ranks_by.value == "n" and page.n.value == 1
    assert p.gpus_per_rank.value == "" and p.cpus_per_rank.value == ""
    assert list(p.placement.options) == list(PLACEMENTS) and p.placement.value == "PACK"
    for form in ("auto", "local", "ray://HEAD:10001"):
        assert f"<code>{form}</code>" in page.address_hint.value
    # the Ray page, the controller address and the nodes' network; not --python, not the others
    assert p._ray_box.layout.display == "" and p._slurm_box.layout.display == "none"
    assert p._local_box.layout.display == "none" and p._ssh_box.layout.display == "none"
    assert p._engines_remote.layout.display == "" and p.python.layout.display == "none"
    assert p._shared_remote.layout.display == "" and p.error.value == ""
    assert "listed here after a start" in p.iface_info.value
    # -n or nodes x engines per node: one shows at a time
    assert page._by_n.layout.display == "" and page._by_nodes.layout.display == "none"
    page.ranks_by.value = "nodes"
    assert page._by_n.layout.display == "none" and page._by_nodes.layout.display == ""
    p.launcher.value = "slurm"
    assert p._ray_box.layout.display == "none" and p.python.layout.display == ""


def test_ray_page_makes_the_call_the_magic_makes(home, ip, monkeypatch):
    p = pk.ClusterPicker(remember=False)
    _ray_page(p)
    name, kw = pk.api_call(p.settings())
    # only what was filled in: CPUs per rank, ip, interface and port keep LaunchOptions' defaults
    assert (name, kw) == (
        "start",
        {
            "launcher": "ray",
            "address": "auto",
            "n": 4,
            "gpus_per_rank": 1,
            "placement": "SPREAD",
            "backend": "auto",
            "timeout": 120.0,
            "force": False,
        },
    )
    # the same start as the magic line: record what %nbtrain start hands nbtrain.start (the
    # recorder stands in for our own API only; starting Ray is tests/cluster/launch/ray/test_ray.py's job)
    calls: list[dict] = []
    monkeypatch.setattr("nbtrain.cluster.api.start", lambda **k: calls.append(k))
    monkeypatch.setattr("nbtrain.magics.cluster.NbtrainMagics._print_ready", lambda *a: None)
    line = "start --launcher ray --address auto -n 4 --gpus-per-rank 1 --placement SPREAD"
    ip.run_line_magic("nbtrain", line)
    (magic,) = calls
    assert {k: magic[k] for k in _START_ONLY} == {k: kw[k] for k in _START_ONLY}
    by_magic = {k: v for k, v in magic.items() if k not in _START_ONLY and k != "quiet"}
    by_picker = {k: v for k, v in kw.items() if k not in _START_ONLY}
    assert by_magic.pop("allocator") is None
    assert parse_launch("ray", {**by_magic, "n": 4}) == parse_launch("ray", {**by_picker, "n": 4})

    # nodes x engines per node instead of -n, and the amounts as typed
    p.ray_page.ranks_by.value = "nodes"
    p.ray_page.nodes.value = "2"
    p.ray_page.engines_per_node.value = "4"
    p.placement.value = "STRICT_PACK"
    p.cpus_per_rank.value = "0.5"
    p.address.value = "ray://head:10001"
    p.port.value = "29555"
    _, kw = pk.api_call(p.settings(), force=True)
    assert "n" not in kw and (kw["nodes"], kw["engines_per_node"]) == (2, 4)
    assert kw["cpus_per_rank"] == 0.5 and kw["address"] == "ray://head:10001"
    assert kw["port"] == 29555 and kw["force"] is True and "remote_python" not in kw
    lo = parse_launch("ray", {k: v for k, v in kw.items() if k not in _START_ONLY})
    assert (lo.n, lo.nodes, lo.engines_per_node, lo.placement) == (8, 2, 4, "STRICT_PACK")


def test_ray_page_messages_as_typed_and_start_refuses(home):
    p = pk.ClusterPicker(remember=False)
    _ray_page(p)
    assert p.error.value == "", p.error.value
    p.address.value = "head-node"  # no port, no ray://
    assert "--address &#x27;head-node&#x27; is not a Ray address" in p.error.value
    assert "ray://HEAD:10001" in p.error.value and "Traceback" not in p.error.value
    p.start_button.click()  # refused before anything connects to Ray
    assert p.cluster is None and not p.start_button.disabled
    assert "is not a Ray address" in p.error.value
    with pytest.raises(ConfigError, match="--address 'head-node' is not a Ray address"):
        pk.start_cluster(p.settings())
    p.address.value = "local"
    assert p.error.value == ""
    p.gpus_per_rank.value = "1.5"
    assert "--gpus-per-rank 1.5: above 1, give a whole number of GPUs" in p.error.value
    p.gpus_per_rank.value = "one"
    assert "--gpus-per-rank &#x27;one&#x27; is not a number of 0 or more" in p.error.value
    p.gpus_per_rank.value = "0.5"
    assert p.error.value == ""
    # SPREAD places single ranks: with nodes x engines it is refused, saying what works
    p.ray_page.ranks_by.value = "nodes"
    assert "--placement SPREAD with --nodes" in p.error.value
    p.placement.value = "PACK"
    p.ray_page.engines_per_node.value = "0"
    assert "--engines-per-node 0 is not a whole number at least 1" in p.error.value
    p.ray_page.engines_per_node.value = "2"
    p.port.value = "70000"  # named once, as the port's own problem
    assert p.error.value.count("70000") == 1 and "is not a TCP port" in p.error.value
    p.port.value = ""
    assert p.error.value == ""


def test_a_bad_placement_is_named(home):
    # the dropdown offers only Ray's four; settings from a script or a file are checked the same way
    s = pk.PickerSettings(launcher="ray", placement="DIAGONAL")
    errors = pk.validate(s)
    assert errors == {
        "ray": "--placement 'DIAGONAL': choose one of PACK, SPREAD, STRICT_PACK, STRICT_SPREAD."
    }
    with pytest.raises(ConfigError, match="--placement 'DIAGONAL'"):
        pk.start_cluster(s)
    assert pk.validate(pk.PickerSettings(launcher="ray", placement="STRICT_SPREAD")) == {}
    pk.save_settings(s)
    assert pk.ClusterPicker().placement.value == "PACK"  # shown as the default, not kept


def test_ray_page_is_remembered_and_restored(home):
    p = pk.ClusterPicker()
    _ray_page(p)
    p.ray_page.ranks_by.value = "nodes"
    p.ray_page.nodes.value = "3"
    p.ray_page.engines_per_node.value = "2"
    p.placement.value = "STRICT_PACK"
    p.cpus_per_rank.value = "2"
    p.address.value = "ray://10.0.0.1:10001"
    pk.save_settings(p.settings())
    saved = json.loads((home / "picker.json").read_text())
    assert saved["address"] == "ray://10.0.0.1:10001" and saved["placement"] == "STRICT_PACK"
    assert (saved["ray_nodes"], saved["ray_engines_per_node"], saved["ray_n"]) == (3, 2, 4)
    q = pk.ClusterPicker()
    assert q.launcher.value == "ray" and q._ray_box.layout.display == ""
    assert q.address.value == "ray://10.0.0.1:10001" and q.placement.value == "STRICT_PACK"
    assert (q.ray_page.ranks_by.value, q.ray_page.nodes.value) == ("nodes", "3")
    assert q.ray_page.engines_per_node.value == "2" and q.ray_page.n.value == 4
    assert (q.gpus_per_rank.value, q.cpus_per_rank.value) == ("1", "2")
    assert q.ray_page._by_nodes.layout.display == ""
    assert q.settings() == p.settings()


def test_settings_saved_before_the_ray_page_still_load(home):
    old = {"launcher": "slurm", "nodes": 2, "gpus_per_node": 4, "partition": "gpu"}
    (home / "picker.json").write_text(json.dumps(old))
    s = pk.load_settings()
    assert (s.address, s.placement, s.ray_ranks_by, s.ray_n) == ("auto", "PACK", "n", 1)
    assert (s.gpus_per_rank, s.cpus_per_rank, s.nodes) == (None, None, 2)
    p = pk.ClusterPicker()
    assert p.launcher.value == "slurm" and p.address.value == "auto"
