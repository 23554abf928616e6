"""notebooks/02-multi-node.ipynb, executed top to bottom on two simulated nodes.

The notebook runs as `nbtrain demo --notebook` runs it (nbtrain.cli.run_notebook: a real Jupyter
kernel, nbclient), with its settings from the environment variables its first cell reads. The
Slurm and existing-cluster sections are switched off (their cells say they were skipped).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import time
import uuid
from pathlib import Path

import nbformat
import psutil
import pytest

from nbtrain.cli import run_notebook
from nbtrain.runs import run_id_for

from .test_ssh_cluster import _node_pids
from .testbed import Testbed

pytestmark = pytest.mark.timeout(420)

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "02-multi-node.ipynb"
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
MARK = "NBTRAIN_TEST_NOTEBOOK_02"  # in the kernel's environment, so in everything it starts


def _marked(mark: str) -> list[int]:
    """Processes on this machine started by the notebook's kernel (the kernel, the controller)."""
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get(MARK) == mark and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except psutil.Error:
            pass
    return out


def _text(cell) -> str:
    parts = []
    for o in cell.get("outputs", []):
        if o.output_type == "stream":
            parts.append(o.text)
        elif o.output_type in ("display_data", "execute_result"):
            parts.append(o.data.get("text/plain", ""))
    return ANSI.sub("", "".join(parts))


def _cell(nb, start: str):
    """The code cell whose source starts with `start`."""
    return next(c for c in nb.cells if c.cell_type == "code" and c.source.startswith(start))


@pytest.fixture(scope="module")
def executed(testbed: Testbed, tmp_path_factory):
    n1, n2 = testbed.nodes[0], testbed.nodes[1]
    out = tmp_path_factory.mktemp("nb02")
    mark = uuid.uuid4().hex
    env = {
        "NBTRAIN_HOSTS": f"{n1.name}:1,{n2.name}:1",
        "NBTRAIN_PYTHON": testbed.remote_python,
        "NBTRAIN_SSH_ARGS": shlex.join(testbed.ssh_args),
        "NBTRAIN_STEPS": "6",
        "NBTRAIN_PROBE_MAX_SIZE": "64K",
        MARK: mark,
    }
    for name in ("NBTRAIN_RUN_SLURM", "NBTRAIN_CONNECT_PROFILE"):
        env[name] = ""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    t0 = time.monotonic()
    try:
        path = run_notebook(NOTEBOOK, out, timeout=240, echo=lambda *a, **k: None)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        # rank 0's run record lands in the node user's own registry (engines started over ssh do
        # not get this session's NBTRAIN_HOME): take it out again
        record = Path.home() / ".local/share/nbtrain/runs"
        (record / f"{run_id_for(out / 'runs' / 'multi-node')}.json").unlink(missing_ok=True)
    return {
        "nb": nbformat.read(path, as_version=4),
        "out": out,
        "mark": mark,
        "seconds": time.monotonic() - t0,
    }


def test_every_cell_ran_without_an_error(executed):
    nb = executed["nb"]
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code), "a cell did not run"
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert errors == [], errors
    stderr = "".join(
        o.text for c in code for o in c.outputs if o.output_type == "stream" and o.name == "stderr"
    )
    assert "Traceback" not in stderr, stderr


def test_ranks_run_on_different_hosts(executed, testbed: Testbed):
    nb = executed["nb"]
    n1, n2 = testbed.nodes[0], testbed.nodes[1]
    start = _text(_cell(nb, "%load_ext nbtrain"))
    assert f"controller listens on {testbed.head_address}" in start, start
    # the rank table: one rank on each node, each with the node's own address
    rows = [ln.split() for ln in start.splitlines() if ln.split()[:1] in (["0"], ["1"])]
    assert [r[1] for r in rows] == [n1.name, n2.name], start
    assert n1.address in start and n2.address in start
    status = _text(_cell(nb, "%nbtrain status"))
    assert n1.name in status and n2.name in status
    reduced = _text(_cell(nb, "%%distributed --output all"))
    hosts = dict(re.findall(r"rank (\d) on (\S+): sum 3 \(expected 3\)", reduced))
    assert hosts == {"0": n1.name, "1": n2.name}, reduced


def test_probe_measured_between_the_nodes(executed):
    probe = _text(_cell(executed["nb"], "%nbtrain probe"))
    assert "all_reduce across 2 rank(s), backend gloo" in probe, probe
    assert "64 KiB" in probe and "node-to-node latency" in probe


def test_finetune_trained_and_rank0_exported_the_adapter(executed, testbed: Testbed):
    nb = executed["nb"]
    listing = _text(_cell(nb, "%%distributed --ranks 0"))
    adapter = executed["out"] / "runs" / "multi-node" / "adapter"
    assert f"adapter on {testbed.nodes[0].name}: {adapter}" in listing, listing
    assert "adapter_config.json" in listing and "adapter_model.safetensors" in listing
    # the nodes share this machine's filesystem: the files are there to read
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"].endswith(f"tiny-llama/{testbed.nodes[0].name}")
    assert (adapter / "adapter_model.safetensors").stat().st_size > 0
    # each node built its own copy of the model
    for node in testbed.nodes[:2]:
        assert (executed["out"] / "tiny-llama" / node.name / "config.json").is_file()
    history = _text(_cell(nb, 'result = nbtrain.current_cluster().pull("result"'))
    steps = [int(ln.split()[1]) for ln in history.splitlines()[1:] if ln.split()]
    assert steps == [2, 4, 6], history


def test_optional_sections_said_they_were_skipped(executed):
    nb = executed["nb"]
    assert "Slurm section skipped" in _text(_cell(nb, "if RUN_SLURM:"))
    assert "Existing-cluster section skipped" in _text(_cell(nb, "if CONNECT_PROFILE:"))


def test_nothing_left_running(executed, testbed: Testbed):
    deadline = time.monotonic() + 15
    while True:
        here = _marked(executed["mark"])
        nodes = {n.name: _node_pids(testbed, n) for n in testbed.nodes}
        if not here and not any(nodes.values()):
            break
        assert time.monotonic() < deadline, f"left running: here {here}, on the nodes {nodes}"
        time.sleep(0.2)
    # the notebook's stop did it, not the kernel's shutdown: its cell said so
    assert "stop" in _text(_cell(executed["nb"], "%nbtrain stop")).lower()
    print(f"notebook 02 on 2 simulated nodes: {executed['seconds']:.1f} s")
