"""Shared fixtures: an IPython shell driven like a user drives it, and real local clusters."""

from __future__ import annotations

import io
import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

SESSION_MARK = "NBTRAIN_TEST_SESSION"


def pytest_configure(config: pytest.Config) -> None:
    """A suite started in the background by a shell without job control (`cmd &` in a script)
    inherits SIGINT ignored, and so does every process it starts: then no interrupt test can
    interrupt anything (Python installs its KeyboardInterrupt handler only where SIGINT is not
    ignored). Python's handler is put back here, and the processes the tests start (exec resets a
    handled signal to its default) get their own again."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` skip themselves where torch sees no CUDA GPU, and say so."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none here")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _nbtrain_home(tmp_path_factory):
    # runs registry and any per-user state go to a temp dir, never the developer's home
    home = tmp_path_factory.mktemp("nbtrain-home")
    old = os.environ.get("NBTRAIN_HOME")
    os.environ["NBTRAIN_HOME"] = str(home)
    # every process this session starts inherits the mark, so that `cluster_processes` can tell
    # them from another test session's running beside this one (make test runs two at once)
    os.environ[SESSION_MARK] = str(home)
    yield home
    os.environ.pop(SESSION_MARK, None)
    if old is None:
        os.environ.pop("NBTRAIN_HOME", None)
    else:
        os.environ["NBTRAIN_HOME"] = old


@pytest.fixture(scope="session")
def ip():
    """The IPython shell, with nbtrain loaded as a user would (%load_ext nbtrain)."""
    from IPython.testing.globalipapp import start_ipython

    shell = start_ipython()
    shell.run_line_magic("load_ext", "nbtrain")
    return shell


def cluster_processes(cluster_id: str | None = None) -> list[psutil.Process]:
    """Controller, engine and nanny processes still alive: of one cluster, or of any cluster this
    test session started (not another session's beside it)."""
    found = []
    mark = os.environ.get(SESSION_MARK)
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "ipyparallel" not in cmd:
            continue
        # ipyparallel passes the cluster id to its processes in the environment, not the command line
        try:
            env = p.environ()
        except psutil.Error:
            env = {}  # gone meanwhile, or not ours to read
        if cluster_id is None:
            if mark is None or env.get(SESSION_MARK) == mark:
                found.append(p)
        elif env.get("IPP_CLUSTER_ID") == cluster_id or cluster_id in cmd:
            found.append(p)
    return found


def wait_gone(pids, timeout=10.0) -> list[int]:
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return [p.pid for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def quiet(fn, *args):
    """Call `fn(*args)` with stdout captured; return what it printed."""
    old, sys.stdout = sys.stdout, io.StringIO()
    try:
        fn(*args)
        return sys.stdout.getvalue()
    finally:
        sys.stdout = old


def run_cell(ip, code, line=""):
    """Run `code` as a `%%distributed` cell (with `line`'s options); return what it printed."""
    return quiet(ip.run_cell_magic, "distributed", line, code)


@contextmanager
def magic_cluster(ip, n: int):
    """An `n`-rank local gloo cluster started and stopped with the magics, as a user would; on exit
    every process it started is gone."""
    import nbtrain

    ip.run_line_magic("nbtrain", "stop")
    quiet(ip.run_line_magic, "nbtrain", f"start -n {n} --backend gloo")
    c = nbtrain.current_cluster()
    assert c is not None and c.world_size == n
    yield c
    pids = list(c.pids)
    ip.run_line_magic("nbtrain", "stop")
    assert wait_gone(pids) == []


@pytest.fixture(scope="module")
def gloo4(ip):
    """A 4-rank local gloo cluster for one test module, one torch thread a rank."""
    with magic_cluster(ip, 4) as c:
        c.execute("import torch; torch.set_num_threads(1)", output="none")
        yield c


@pytest.fixture(scope="module")
def one_torch_thread():
    """One BLAS thread for the module's in-process training: on the small shared test machine that is
    several times faster than two."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama and its tokenizer saved with save_pretrained (nbtrain.model.tiny), one per module."""
    from nbtrain.model.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


LR_RATES = (1e-2, 1e-3)


@pytest.fixture(scope="module")
def two_lr_runs(tiny, tmp_path_factory):
    """Two real tiny finetune runs (6 steps, an eval every 3) that differ only in learning rate,
    LR_RATES, in `root`/lr-0.01 and `root`/lr-0.001 (nothing else in `root`): {"root": root, "runs":
    [{"cfg", "result", "started", "ended"}, ...]}, one per module (for the runs comparison in
    tests/compare/test_compare.py and the Lab's compare endpoint in tests/server/test_handlers.py)."""
    import torch

    from nbtrain.configs.sft import SFTConfig
    from nbtrain.recipes.train import finetune

    data = (
        Path(__file__).resolve().parents[1] / "nbtrain" / "data" / "examples" / "instructions.jsonl"
    )
    root = tmp_path_factory.mktemp("compare") / "runs"
    eval_rows = [json.loads(x) for x in data.read_text().splitlines()[:8]]
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    done = []
    try:
        for lr in LR_RATES:
            cfg = SFTConfig(
                model=tiny,
                data=str(data),
                eval_data=eval_rows,
                eval_steps=3,
                output_dir=str(root / f"lr-{lr:g}"),
                max_steps=6,
                per_device_train_batch_size=4,
                learning_rate=lr,
                max_length=48,
                logging_steps=1,
                save_steps=None,
                lora_r=8,
                lora_dropout=0.0,
            )
            started = time.time()
            result = finetune(cfg)
            done.append({"cfg": cfg, "result": result, "started": started, "ended": time.time()})
    finally:
        torch.set_num_threads(old)
    return {"root": root, "runs": done}
