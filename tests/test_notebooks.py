"""Notebooks in a real Jupyter kernel (nbclient), as CI and `nbtrain demo` run them.

Not IPython's test shell: display, plots, errors and shutdown go through a real kernel and its
iopub channel, so what these tests see is what a saved notebook keeps.
"""

from __future__ import annotations

import json
import re
import socket
import sys
import time
from pathlib import Path

import nbformat
import psutil
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from nbformat.v4 import new_code_cell, new_notebook

from nbtrain.cli import _kernel_manager, quickstart_path
from tests.conftest import wait_gone

# what JupyterLab and nbclient give a kernel to exit before SIGTERM (half) and SIGKILL: the tests
# shut kernels down the way users' kernels are shut down
JUPYTER_SHUTDOWN_WAIT = 5.0
# Stopping a cluster takes 5-10 s today (ipyparallel's stop_cluster_sync ~5 s, then a 3 s grace in
# nbtrain.procs.kill_tree for processes it left), and the atexit hook starts it ~2 s after the
# shutdown request, so a kernel is SIGTERMed mid-teardown: whether the engines outlive it is a race.
# Owned by the cluster core; remove the mark when teardown fits in Jupyter's 2.5 s.
ROOT = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

# prints, as JSON, every process the kernel started for the cluster: the controller, the engines and
# their nannies are all the kernel's descendants
WHO_RUNS = """\
import json, os, psutil, nbtrain
_c = nbtrain.current_cluster()
print("PROCS " + json.dumps({
    "kernel": os.getpid(),
    "ranks": [r.pid for r in _c.ranks],
    "tree": [p.pid for p in psutil.Process().children(recursive=True)],
}))
"""


def _left_running(pids: list[int], timeout: float) -> list[int]:
    """Those of `pids` still alive after `timeout` s; they are killed, so a failure leaks nothing."""
    left = wait_gone(pids, timeout=timeout)
    for pid in left:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    return left


def _notebook(*sources: str) -> nbformat.NotebookNode:
    nb = new_notebook(cells=[new_code_cell(s) for s in sources])
    nb.metadata.kernelspec = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def _execute(nb: nbformat.NotebookNode, folder: Path, timeout: int = 300) -> None:
    """Run `nb` top to bottom in a fresh kernel started in `folder`, shut down as Jupyter does."""
    client = NotebookClient(
        nb,
        km=_kernel_manager(JUPYTER_SHUTDOWN_WAIT),
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(folder)}},
    )
    client.execute(cleanup_kc=True)


def _all_text(nb: nbformat.NotebookNode) -> str:
    """Every code cell's output as text (rich outputs as their JSON), ANSI colours removed."""
    return "\n".join(
        ANSI.sub("", out.get("text", "") or json.dumps(out.get("data", {})))
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
    )


def _stdout(cell: nbformat.NotebookNode) -> str:
    return "".join(o.text for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")


def _procs(cell: nbformat.NotebookNode) -> dict:
    line = next(ln for ln in _stdout(cell).splitlines() if ln.startswith("PROCS "))
    return json.loads(line[len("PROCS ") :])


def test_shipped_quickstart_is_the_repo_notebook():
    # `nbtrain demo` runs the copy inside the package (so a wheel has it); it must not drift
    repo_copy = ROOT / "notebooks" / "01-quickstart.ipynb"
    assert quickstart_path().read_bytes() == repo_copy.read_bytes(), (
        "nbtrain/notebooks/01-quickstart.ipynb differs from notebooks/01-quickstart.ipynb; "
        "copy the notebook you edited over the other"
    )


@pytest.fixture(scope="module")
def failing_run(tmp_path_factory):
    """One kernel: start 2 ranks, display + plot from rank 0, then a cell that fails on rank 1.

    nbclient stops at the failing cell and shuts the kernel down; the tests below look at what it
    raised, what the executed notebook holds, and which processes outlive the kernel.
    """
    nb = _notebook(
        "import sys\nprint(sys.executable)",
        "%load_ext nbtrain\n%nbtrain start -n 2",
        WHO_RUNS,
        """%%distributed
from IPython.display import HTML, display
import matplotlib.pyplot as plt

if rank == 0:
    display(HTML("<b>shown by rank 0</b>"))
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot([1, 3, 2])
    plt.show()
print(f"rank {rank} done")""",
        """%%distributed
if rank == 1:
    raise ValueError("boom on rank one")""",
        "print('never reached')",
    )
    client = NotebookClient(
        nb,
        km=_kernel_manager(JUPYTER_SHUTDOWN_WAIT),
        timeout=120,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path_factory.mktemp("nb"))}},
    )
    with pytest.raises(CellExecutionError) as info:
        # shut the kernel down when done, as nbclient does with a kernel manager of its own
        client.execute(cleanup_kc=True)
    ended = time.monotonic()
    return {"nb": nb, "error": info.value, "ended": ended}


def test_kernel_is_this_python(failing_run):
    assert _stdout(failing_run["nb"].cells[0]).strip() == sys.executable


def test_rank0_display_and_plot_reach_the_notebook(failing_run):
    cell = failing_run["nb"].cells[3]
    outputs = [o for o in cell.outputs if o.output_type == "display_data"]
    html = [o for o in outputs if "shown by rank 0" in o.data.get("text/html", "")]
    pngs = [o for o in outputs if "image/png" in o.data]
    assert len(html) == 1, cell.outputs
    assert len(pngs) == 1, cell.outputs
    import base64

    assert base64.b64decode(pngs[0].data["image/png"])[:8] == b"\x89PNG\r\n\x1a\n"
    # rank 0's stdout only, by default
    assert _stdout(cell) == "rank 0 done\n"


def test_failure_on_rank1_fails_the_notebook_once(failing_run):
    err = failing_run["error"]
    text = ANSI.sub("", str(err))
    assert err.ename == "DistributedCellError"
    assert f"ValueError: boom on rank one  [rank 1 on {socket.gethostname()}]" in text
    assert "the cell failed on 1 of 2 rank(s)" in text
    # the remote traceback (with the raising line) is shown once, not once per rank or twice;
    # nbclient's message quotes the cell's source first, separated by dashes
    shown_error = text.split("-" * 18)[-1]
    assert shown_error.count('raise ValueError("boom on rank one")') == 1, text
    nb = failing_run["nb"]
    cell = nb.cells[4]
    errors = [o for o in cell.outputs if o.output_type == "error"]
    assert len(errors) == 1
    shown = ANSI.sub("", "\n".join(errors[0].traceback) + _stdout(cell))
    assert shown.count('raise ValueError("boom on rank one")') == 1, shown
    # nbclient stopped at the failure
    assert nb.cells[5].get("outputs") == []


def test_kernel_shutdown_leaves_no_cluster_process(failing_run):
    procs = _procs(failing_run["nb"].cells[2])
    assert set(procs["ranks"]) <= set(procs["tree"]), procs
    assert len(procs["tree"]) >= 3  # controller + 2 engines at least
    left = _left_running(
        procs["tree"], timeout=max(0.1, 10 - (time.monotonic() - failing_run["ended"]))
    )
    assert left == [], f"processes of the cluster still running after the kernel shut down: {left}"


def test_log_without_a_cluster_draws_in_the_kernel(tmp_path):
    """An own loop in a plain notebook (no cluster, no `begin`): the rows draw the charts, and
    `nbtrain.log_end()` leaves the final image and the last row's table."""
    nb = _notebook(
        "import nbtrain\n"
        "for i in range(1, 6):\n"
        "    nbtrain.log(step=i, loss=1.0 / i, tokens_per_s=100.0 * i, learning_rate=0.01)\n"
        "nbtrain.log_end()",
    )
    _execute(nb, tmp_path, timeout=120)
    outputs = [
        o for o in nb.cells[0].outputs if o.output_type in ("display_data", "update_display_data")
    ]
    assert outputs, nb.cells[0].outputs
    text = " ".join(o.data.get("text/html", "") + o.data.get("text/plain", "") for o in outputs)
    # the charts are a PNG inside the live display's HTML
    assert "<img src='data:image/png;base64," in text, f"no chart drawn: {nb.cells[0].outputs}"
    # the final table holds the last row (step 5, learning_rate kept though it is not plotted)
    assert "learning_rate" in text and "0.2" in text, text[-2000:]


def test_kernel_restart_leaves_no_cluster_process():
    """JupyterLab's Restart Kernel is a graceful restart: shutdown_request(restart=True), then a new kernel."""
    km = _kernel_manager(JUPYTER_SHUTDOWN_WAIT)
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    out: list[str] = []

    def run(code: str) -> None:
        reply = kc.execute_interactive(
            code,
            timeout=120,
            output_hook=lambda msg: (
                out.append(msg["content"].get("text", "")) if msg["msg_type"] == "stream" else None
            ),
        )
        assert reply["content"]["status"] == "ok", reply["content"]

    try:
        kc.wait_for_ready(timeout=60)
        run("%load_ext nbtrain\n%nbtrain start -n 2")
        run(WHO_RUNS)
        line = next(ln for ln in "".join(out).splitlines() if ln.startswith("PROCS "))
        procs = json.loads(line[len("PROCS ") :])
        assert len(procs["tree"]) >= 3
        km.restart_kernel(now=False)
        left = _left_running(procs["tree"], timeout=10)
        assert left == [], f"processes of the cluster still running after a kernel restart: {left}"
        # the restarted kernel is a fresh one and works
        kc.wait_for_ready(timeout=60)
        out.clear()
        run("import os; print(os.getpid())")
        assert int("".join(out).strip()) != procs["kernel"]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


@pytest.mark.timeout(400)
def test_gpu_notebook_runs_on_cpu_and_shows_the_plan(tmp_path, monkeypatch):
    """notebooks/03-gpu-training.ipynb top to bottom in a real kernel, on this CPU-only machine: the
    device plan, auto batch with a global batch, packing, and the levers the run used."""
    monkeypatch.setenv("NBTRAIN_DEMO_OUT", str(tmp_path / "out"))
    nb = nbformat.read(ROOT / "notebooks" / "03-gpu-training.ipynb", as_version=4)
    _execute(nb, tmp_path)
    text = _all_text(nb)
    assert "gloo ['cpu']" in text, text[-3000:]  # one engine without GPUs, gloo on CPU
    assert "global_batch: 8" in text
    assert "auto batch:" in text and "loss chunked" in text
    assert (tmp_path / "out" / "runs" / "packed" / "adapter" / "adapter_config.json").is_file()


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("ray") is None,
    reason='no ray here (pip install "ray[default]")',
)
def test_ray_and_groups_notebook_runs(tmp_path):
    """notebooks/04-ray-and-groups.ipynb top to bottom in a real kernel: four ranks as actors of a
    private Ray, the node check, two disjoint groups reducing at once, a cell on one group, stop."""
    nb = nbformat.read(ROOT / "notebooks" / "04-ray-and-groups.ipynb", as_version=4)
    _execute(nb, tmp_path)
    text = _all_text(nb)
    assert "placement group nbtrain-" in text and "PACK" in text
    for rank, role, total in (
        (0, "actor", 1),
        (1, "actor", 1),
        (2, "rollout", 5),
        (3, "rollout", 5),
    ):
        assert f"rank {rank} ({role}): sum in my group = {total}" in text, text
    assert "rank 2: rank 0 of 2 in the rollout group" in text
    assert "rank 3: rank 1 of 2 in the rollout group" in text
    only = next(c for c in nb.cells if c.source.startswith("%%distributed --group rollout"))
    shown = "".join(o.get("text", "") for o in only.outputs)
    assert "rank 0:" not in shown and "rank 1:" not in shown, shown


@pytest.mark.timeout(400)
def test_compare_notebook_runs(tmp_path, monkeypatch):
    """notebooks/06-compare-runs.ipynb top to bottom in a real kernel: two runs on two engines at two
    learning rates, then nbtrain.compare's image and table in the cell output, and its saved files."""
    import base64

    monkeypatch.setenv("NBTRAIN_DEMO_OUT", str(tmp_path / "out"))
    nb = nbformat.read(ROOT / "notebooks" / "06-compare-runs.ipynb", as_version=4)
    _execute(nb, tmp_path)
    shown = next(c for c in nb.cells if c.source.startswith("cmp = nbtrain.compare"))
    page = next(o.data["text/html"] for o in shown.outputs if "text/html" in o.get("data", {}))
    img = page.split('src="data:image/png;base64,', 1)[1].split('"', 1)[0]
    assert base64.b64decode(img)[:8] == b"\x89PNG\r\n\x1a\n"
    assert "lr-0.001" in page and "lr-0.01" in page and "learning_rate" in page
    printed = _stdout(next(c for c in nb.cells if c.source.startswith("print(cmp.diff)")))
    # the diff holds the one setting the runs differ in, in run order
    lines = printed.splitlines()
    assert lines[1].split() == ["learning_rate", "0.001", "0.01"], printed
    assert "['csv', 'md', 'png']" in printed
    assert (tmp_path / "out" / "compare" / "compare.png").is_file()
    for lr in ("0.001", "0.01"):
        run = tmp_path / "out" / "runs" / f"lr-{lr}"
        assert json.loads((run / "sft_config.json").read_text())["learning_rate"] == float(lr)
        assert (run / "adapter" / "adapter_config.json").is_file()


@pytest.mark.timeout(400)
def test_frameworks_notebook_runs(tmp_path):
    """notebooks/05-frameworks.ipynb top to bottom in a real kernel: Lightning's Trainer(strategy="ddp")
    and accelerate on two CPU ranks, unchanged from torchrun, and nbtrain's group after them."""
    nb = nbformat.read(ROOT / "notebooks" / "05-frameworks.ipynb", as_version=4)
    _execute(nb, tmp_path)
    text = _all_text(nb)
    for rank in (0, 1):
        assert f"RANK={rank} LOCAL_RANK={rank} WORLD_SIZE=2 GROUP_RANK=0 GROUP_WORLD_SIZE=1" in text
        assert f"rank {rank}: same weights as rank 0: True; group kept: True" in text, text
    assert "TorchElasticEnvironment, world size 2, loss" in text
    assert "MULTI_CPU, 2 processes, loss" in text
    assert "the group is still there: 1 + 2 = 3" in text
    assert "interactive environment" not in text


@pytest.mark.timeout(400)
def test_sharding_notebook_runs(tmp_path, monkeypatch):
    """notebooks/07-sharding-and-qlora.ipynb top to bottom in a real kernel: the same run as ddp, fsdp
    and QLoRA under fsdp on two CPU ranks, each rank's share of the base, and the QLoRA adapter on
    the unquantised base."""
    monkeypatch.setenv("NBTRAIN_DEMO_OUT", str(tmp_path / "out"))
    nb = nbformat.read(ROOT / "notebooks" / "07-sharding-and-qlora.ipynb", as_version=4)
    _execute(nb, tmp_path)
    text = _all_text(nb)
    for rank in (0, 1):
        assert re.search(
            rf"rank {rank}, ddp: loss [\d.]+; this rank holds 100% of the base", text
        ), text
        assert re.search(rf"rank {rank}, fsdp: loss [\d.]+; this rank holds 50% of the base", text)
        assert re.search(
            rf"rank {rank}, qlora-fsdp: loss [\d.]+; this rank holds 50% .*4-bit NF4", text
        )
    assert "QLoRA adapter on the unquantised base:" in text
    assert "70B, shard='fsdp', load_in_4bit:" in text


@pytest.mark.timeout(400)
def test_real_data_notebook_runs(tmp_path, monkeypatch):
    """notebooks/08-real-data.ipynb top to bottom in a real kernel: 25,000 chat rows tokenized once on
    two ranks into a token cache, the same run again from the cache, and a file with bad rows refused
    before any step with each bad row's line and index, nothing cached for it."""
    monkeypatch.setenv("NBTRAIN_DEMO_OUT", str(tmp_path / "out"))
    nb = nbformat.read(ROOT / "notebooks" / "08-real-data.ipynb", as_version=4)
    _execute(nb, tmp_path)
    out = tmp_path / "out"
    cache = out / "data-cache"

    def shown(start: str) -> str:
        cell = next(c for c in nb.cells if c.source.startswith(start))
        return ANSI.sub("", _stdout(cell))

    first = shown("%%distributed\nimport os")
    assert "nbtrain: data: checking and tokenizing" in first, first[-3000:]
    found = re.search(
        r"nbtrain: data: 25,000 rows, ([\d,]+) tokens in [\d.]+ s \([\d,]+ rows/s\), cached at "
        rf"({re.escape(str(cache))}/\w+), [\d.]+ MiB \(([\d.]+) bytes/token\)",
        first,
    )
    assert found, first[-3000:]
    n_tokens, folder = found[1], found[2]
    assert 5.0 <= float(found[3]) < 6.0  # 5 bytes a token and 24 a row, as docs/fine-tuning.md says
    assert "step 6/6 | loss" in first

    again = shown("%%distributed\nsecond_run")
    assert f"25,000 rows, {n_tokens} tokens, from the cache at {folder} " in again, again
    assert "nbtrain: data: checking and tokenizing" not in again
    times = re.search(r"([\d.]+) s the first time .*, ([\d.]+) s from the cache", again)
    assert times and float(times[2]) < float(times[1]), again

    refused = shown("%%distributed\nfrom nbtrain.errors import ConfigError")
    assert "bad.jsonl': 3 of 7 rows are refused, nothing was trained or cached" in refused, refused
    for line, row, why in (
        (3, 1, "has content of type int"),
        (5, 3, "has role 'robot'"),
        (9, 5, "at least one 'assistant' turn"),
    ):
        assert re.search(rf"bad\.jsonl' line {line} row {row}: .*{why}", refused), refused
    assert "step 1/" not in refused
    # nothing cached for bad.jsonl (the one file beside the cache folders is sources.json: digests)
    assert [p.name for p in cache.iterdir() if p.is_dir()] == [Path(folder).name]
    assert not (out / "runs" / "bad").exists()
    for run in ("first", "second"):
        assert (out / "runs" / run / "adapter" / "adapter_config.json").is_file()


@pytest.mark.timeout(400)
def test_samples_notebook_runs(tmp_path, monkeypatch):
    """notebooks/09-samples.ipynb top to bottom in a real kernel: the base model sampled on two ranks,
    a fine-tune sampling every 20 steps (samples.jsonl, the live table), base and tuned side by side."""
    monkeypatch.setenv("NBTRAIN_DEMO_OUT", str(tmp_path / "out"))
    nb = nbformat.read(ROOT / "notebooks" / "09-samples.ipynb", as_version=4)
    _execute(nb, tmp_path)
    text = _all_text(nb)
    assert "step 80/80 | loss" in text, text[-3000:]
    # no noise of transformers' in the outputs a reader sees: a deprecation notice, a loading bar
    assert "FutureWarning" not in text and "Loading weights" not in text, text[-3000:]
    run = tmp_path / "out" / "runs" / "tuned"
    rows = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["index"]) for r in rows] == [
        (s, i) for s in (0, 20, 40, 60, 80) for i in range(4)
    ]
    assert all(r["reference"] for r in rows)
    # the live display's table under the plot, newest step first
    assert "samples at step 80:" in text and "<th style='text-align:left'>step 80</th>" in text
    by_step = {s: [r["completion"] for r in rows if r["step"] == s] for s in (0, 80)}
    assert by_step[0] != by_step[80]  # training moved the completions
    # side by side: one column per model, and the reference
    side = next(c for c in nb.cells if c.source.startswith('side = cluster.pull("side"'))
    table = side.outputs[0]["data"]["text/html"]
    for column in ("prompt", "base", "tuned", "reference"):
        assert f"<th>{column}</th>" in table, table


@pytest.mark.timeout(400)
def test_preference_notebook_runs(tmp_path, monkeypatch):
    """notebooks/10-preference-and-rl.ipynb top to bottom in a real kernel: DPO on the shipped pairs on
    two CPU ranks, TRL's reward metrics in every logged row, and the reward margin clearly grown; then
    GRPO collocated and disaggregated, the mean reward clearly grown in both."""
    monkeypatch.setenv("NBTRAIN_DEMO_OUT", str(tmp_path / "out"))
    nb = nbformat.read(ROOT / "notebooks" / "10-preference-and-rl.ipynb", as_version=4)
    _execute(nb, tmp_path)
    text = _all_text(nb)
    assert "step 40/40 | loss" in text, text[-3000:]
    found = re.search(
        r"rewards/margins: (-?[\d.]+) \(first 5 rows\) -> (-?[\d.]+) \(last 5\)", text
    )
    assert found and float(found[2]) > float(found[1]) + 0.1, text[-3000:]
    run = tmp_path / "out" / "runs" / "dpo"
    assert (run / "adapter" / "adapter_config.json").is_file()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 20 and all("rewards/accuracies" in r and "logps/chosen" in r for r in rows)
    # then GRPO, collocated and disaggregated (actor=0 rollout=1): both learn the digits format
    for name, folder in (("collocated", "grpo"), ("disaggregated", "grpo-split")):
        got = re.search(
            rf"GRPO {name}: reward ([\d.]+) \(step 1\) -> ([\d.]+) \(last 3 steps\)", text
        )
        assert got and float(got[2]) > float(got[1]) + 0.3, text[-3000:]
        assert (tmp_path / "out" / "runs" / folder / "adapter" / "adapter_config.json").is_file()


@pytest.mark.timeout(300)
def test_steppable_notebook_runs(tmp_path, monkeypatch):
    """notebooks/12-steppable-run.ipynb top to bottom in a real kernel: nbtrain.Run on two ranks, 30
    steps, a look, a lower learning rate, 30 more on one curve; GRPO with its reward swapped."""
    monkeypatch.setenv("NBTRAIN_DEMO_OUT", str(tmp_path / "out"))
    nb = nbformat.read(ROOT / "notebooks" / "12-steppable-run.ipynb", as_version=4)
    _execute(nb, tmp_path)
    text = _all_text(nb)
    assert "state='paused', global_step=30" in text and "state='done', global_step=60" in text
    assert "steps logged: [5, 10, 15, 20, 25, 30, 35, 40, 45, 50, 55, 60]" in text, text[-3000:]
    run = tmp_path / "out" / "runs" / "stepped"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(5, 65, 5))
    # linear decay after 5 warmup steps; the peak went from 5e-3 to 2e-3 after step 30
    assert rows[5]["learning_rate"] == pytest.approx(5e-3 * (60 - 29) / 55, rel=1e-9)
    assert rows[6]["learning_rate"] == pytest.approx(2e-3 * (60 - 34) / 55, rel=1e-9)
    assert (run / "adapter" / "adapter_config.json").is_file()
    grpo = [
        json.loads(x)
        for x in (tmp_path / "out" / "runs" / "grpo-stepped" / "metrics.jsonl")
        .read_text()
        .splitlines()
    ]
    assert ["rewards/digits/mean" in r for r in grpo] == [True] * 4 + [False] * 4
    assert ["rewards/brief/mean" in r for r in grpo] == [False] * 4 + [True] * 4


@pytest.mark.timeout(400)
def test_tinker_notebook_runs(tmp_path, monkeypatch):
    """notebooks/11-tinker.ipynb top to bottom in a real kernel: the Tinker service on two ranks, an SFT
    loop through the tinker SDK in a cell with the service's live plot, sampling, one RL step per reward
    (the reward changed between cells), and a sampler adapter exported that peft loads."""
    pytest.importorskip("tinker")
    monkeypatch.setenv("NBTRAIN_DEMO_OUT", str(tmp_path / "out"))
    monkeypatch.setenv("NBTRAIN_HOME", str(tmp_path / "home"))
    nb = nbformat.read(ROOT / "notebooks" / "11-tinker.ipynb", as_version=4)
    _execute(nb, tmp_path)
    text = _all_text(nb)
    assert "FutureWarning" not in text, text[-3000:]
    sft = re.search(r"SFT: loss ([\d.]+) \(first 5 steps\) -> ([\d.]+) \(last 5\)", text)
    assert sft and float(sft[2]) < float(sft[1]) - 0.5, text[-3000:]
    # the service's live plot, drawn under the loop's cell
    loop = next(c for c in nb.cells if c.source.startswith("losses = []"))
    assert any(
        "data:image/png;base64," in o.get("data", {}).get("text/html", "") for o in loop.outputs
    )
    samples = re.findall(r" -> .*  \((stop|length), logprob (-?[\d.]+)\)", text)
    assert len(samples) == 8 and all(float(lp) <= 0 for _, lp in samples), text[-3000:]
    for reward in ("short", "has_vowel"):
        rl = re.search(rf"RL step, reward '{reward}': mean reward ([\d.]+), loss (-?[\d.]+)", text)
        assert rl and 0.0 <= float(rl[1]) <= 1.0, text[-3000:]
    assert re.search(r"tinker://\S+:train:\d+/sampler_weights/final", text), text[-3000:]
    assert "['adapter_config.json', 'adapter_model.safetensors']" in text
    assert re.search(r"PeftModelForCausalLM: logits of shape \(1, \d+, \d+\)", text), text[-3000:]


# the cells of notebooks/10 that its vLLM section needs: the set-up, section 3's GRPO settings and
# reward (its collocated run), then section 5 and the stop; DPO and the disaggregated run are the
# main lane's (test_preference_notebook_runs, where section 5 says it skips)
VLLM_SECTION_CELLS = (
    "5c9eb26c",
    "522ec81d",
    "fd2780af",
    "0e033ac4",
    "3d5f0c47",
    "9a4c6e18",
    "49a6df44",
)


@pytest.mark.timeout(500)
def test_preference_notebooks_vllm_section_runs(tmp_path, monkeypatch):
    """notebooks/10's section 5 in a real kernel where vLLM is installed (the vLLM lane's venv): GRPO
    with its rollouts sampled by vLLM on two CPU ranks learns the digits format."""
    pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs this")
    monkeypatch.setenv("NBTRAIN_DEMO_OUT", str(tmp_path / "out"))
    nb = nbformat.read(ROOT / "notebooks" / "10-preference-and-rl.ipynb", as_version=4)
    by_id = {c.get("id"): c for c in nb.cells}
    assert set(VLLM_SECTION_CELLS) <= set(by_id), "notebooks/10's cells were renumbered"
    nb.cells = [by_id[i] for i in VLLM_SECTION_CELLS]
    _execute(nb, tmp_path, timeout=450)
    text = _all_text(nb)
    assert "skipped" not in text, text[-3000:]
    got = re.search(
        r"GRPO through vLLM: reward ([\d.]+) \(step 1\) -> ([\d.]+) \(last 3 steps\)", text
    )
    assert got and float(got[2]) > float(got[1]) + 0.3, text[-3000:]
    run = tmp_path / "out" / "runs" / "grpo-vllm"
    assert (run / "adapter" / "adapter_config.json").is_file()
