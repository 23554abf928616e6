"""`SFTConfig(report_to=...)`: real runs of `finetune` (world size 1, the tiny model) read back with
TensorBoard's event reader and MLflow's own client, a crash and resume, and the refusals."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
import torch

from nbtrain.errors import ConfigError
from nbtrain.recipes import step as step_mod
from nbtrain.recipes.train import finetune
from nbtrain.telemetry import tracking
from tests.recipes.test_train import make_cfg

DATA = str(
    Path(__file__).resolve().parents[2] / "nbtrain" / "data" / "examples" / "instructions.jsonl"
)
BOTH = ["tensorboard", "mlflow"]
COLUMNS = ("loss", "grad_norm", "learning_rate", "tokens_per_s", "step_time", "epoch")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", autouse=True)
def mlflow_store(tmp_path_factory):
    """One sqlite MLflow store for the module (creating its tables takes seconds); each test picks
    its own experiment with MLFLOW_EXPERIMENT_NAME. The working folder is a temporary one too: the
    store puts artifacts in ./mlruns."""
    where = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{where / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        mp.chdir(where)
        yield uri


def _tensorboard(folder: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _scalars(acc, tag: str) -> dict[int, float]:
    events = acc.Scalars(tag)
    steps = [e.step for e in events]
    assert len(steps) == len(set(steps)), f"{tag}: a step twice: {steps}"
    return {e.step: e.value for e in events}


def _mlflow(run_id: str, key: str) -> dict[int, float]:
    from mlflow.tracking import MlflowClient

    history = MlflowClient().get_metric_history(run_id, key)
    steps = [m.step for m in history]
    assert len(steps) == len(set(steps)), f"{key}: a step twice: {steps}"
    return {m.step: m.value for m in history}


def _only_run(experiment: str):
    import mlflow

    runs = mlflow.search_runs(experiment_names=[experiment])
    assert len(runs) == 1, runs[["run_id", "status"]]
    return runs.iloc[0]


def test_report_to_is_checked_where_the_config_is_built(tiny, tmp_path, monkeypatch):
    assert make_cfg(tiny, tmp_path).report_to == []
    assert make_cfg(tiny, tmp_path, report_to="tensorboard").report_to == ["tensorboard"]
    assert make_cfg(tiny, tmp_path, report_to=("mlflow", "tensorboard", "mlflow")).report_to == [
        "mlflow",
        "tensorboard",
    ]
    assert make_cfg(tiny, tmp_path, report_to="all").report_to == BOTH
    with pytest.raises(ConfigError, match="'wandb' is not supported"):
        make_cfg(tiny, tmp_path, report_to=["tensorboard", "wandb"])
    with pytest.raises(ConfigError, match="logging_dir"):
        make_cfg(tiny, tmp_path, logging_dir=3)

    # a package this process cannot import: a None entry in sys.modules is what the import system
    # treats as "not there" (find_spec returns None, import raises)
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(ConfigError) as info:
        make_cfg(tiny, tmp_path, report_to=BOTH)
    msg = str(info.value)
    assert "report_to='mlflow' needs the mlflow package" in msg and "pip install mlflow" in msg
    assert socket.gethostname() in msg and "tensorboard" not in msg.split("mlflow package")[1]
    assert make_cfg(tiny, tmp_path, report_to="all").report_to == ["tensorboard"]  # the installed
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ConfigError, match="pip install tensorboard"):
        make_cfg(tiny, tmp_path, report_to="tensorboard")
    assert make_cfg(tiny, tmp_path, report_to="all").report_to == []


def test_tensorboard_and_mlflow_hold_the_history_and_a_resume_continues_them(
    tiny, tmp_path, monkeypatch
):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "resume")
    out = tmp_path / "run"
    eval_rows = [json.loads(x) for x in Path(DATA).read_text().splitlines()[:8]]
    kw = dict(save_steps=3, eval_data=eval_rows, eval_steps=3, report_to=BOTH, run_name="resumable")

    # the first attempt dies in step 5's forward: checkpoint-3 is saved, rows 1..4 are logged
    orig = step_mod.loss_sum
    calls = [0]

    def dying(net, *a, **k):
        if net.training:
            calls[0] += 1
            if calls[0] == 5:
                raise RuntimeError("simulated crash in step 5")
        return orig(net, *a, **k)

    monkeypatch.setattr(step_mod, "loss_sum", dying)
    with pytest.raises(RuntimeError, match="simulated crash"):
        finetune(make_cfg(tiny, out, **kw))
    monkeypatch.setattr(step_mod, "loss_sum", orig)
    first = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in first] == [1, 2, 3, 4]
    run_id = json.loads((out / tracking.RUN_FILE).read_text())["run_id"]
    crashed = _only_run("resume")
    assert crashed.run_id == run_id and crashed.status == "FAILED"
    assert sorted(_mlflow(run_id, "loss")) == [1, 2, 3, 4]

    result = finetune(make_cfg(tiny, out, resume="latest", **kw))
    h = result.history.set_index("step")
    assert list(h.index) == [1, 2, 3, 4, 5, 6]

    # MLflow: the same run, finished, every column by step, each step once
    run = _only_run("resume")
    assert run.run_id == run_id and run.status == "FINISHED"
    assert run["tags.mlflow.runName"] == "resumable"
    assert run["params.learning_rate"] == "0.01" and run["params.report_to"] == str(BOTH)
    assert run["params.world_size"] == "1" and run["params.max_steps"] == "6"
    for col in COLUMNS:
        got = _mlflow(run_id, col)
        assert sorted(got) == [1, 2, 3, 4, 5, 6], col
        # step 4 is the first attempt's (the resumed run redid it, and MLflow keeps one value)
        for step in (1, 2, 3, 5, 6):
            assert got[step] == h.loc[step, col], (col, step)
        assert got[4] == first[3][col], col
    # a resumed run trains as an uninterrupted one: the redone step 4 has the same loss
    torch.testing.assert_close(_mlflow(run_id, "loss")[4], float(h.loc[4, "loss"]))
    evals = _mlflow(run_id, "eval_loss")
    assert sorted(evals) == [3, 6] and evals[6] == h.loc[6, "eval_loss"]
    assert "mfu" not in run and "metrics.peak_memory_gb" not in run  # GPU-only columns
    artifacts = [a.path for a in MlflowClient().list_artifacts(run_id, "adapter")]
    assert "adapter/adapter_model.safetensors" in artifacts, artifacts

    # TensorBoard: one folder, two event files (first attempt and resume), each step once, and the
    # steps after the checkpoint are the redone ones
    assert len(list((out / "runs").glob("events.out.tfevents.*"))) == 2
    acc = _tensorboard(out / "runs")
    for col in COLUMNS:
        got = _scalars(acc, f"train/{col}")
        assert sorted(got) == [1, 2, 3, 4, 5, 6], col
        for step, value in got.items():
            assert value == pytest.approx(h.loc[step, col], rel=1e-6), (col, step)
    assert sorted(_scalars(acc, "eval/loss")) == [3, 6]
    config = acc.Tensors("config/text_summary")
    assert len(config) == 1
    saved = json.loads(config[0].tensor_proto.string_val[0].decode())
    assert saved["learning_rate"] == 0.01 and saved["report_to"] == BOTH


def test_a_tracker_that_cannot_open_stops_the_run_before_any_step(tiny, tmp_path, monkeypatch):
    # an MLflow server that is not there: MLflow's client gives up at once instead of retrying
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    out = tmp_path / "down"
    with pytest.raises(ConfigError) as info:
        finetune(make_cfg(tiny, out, report_to=BOTH))
    msg = str(info.value)
    assert f"MLflow tracking store http://127.0.0.1:{port} failed" in msg
    assert "MLFLOW_TRACKING_URI" in msg and "drop 'mlflow' from report_to" in msg
    assert not out.exists()

    # a config built where TensorBoard was installed, run where it cannot be imported
    cfg = make_cfg(tiny, out, report_to="tensorboard")
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError, match="pip install tensorboard"):
        finetune(cfg)
    assert not out.exists()


def test_mlflow_failing_mid_run_warns_trains_on_and_sends_the_rows_at_the_end(
    tiny, tmp_path, monkeypatch, capsys
):
    # the store is real; one send fails as a server gone for a moment would (the client has retried)
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "flaky")
    real = MlflowClient.log_batch
    fails = [1]

    def flaky(self, run_id, metrics=(), *a, **k):
        if metrics and any(m.step == 2 for m in metrics) and fails[0]:
            fails[0] -= 1
            raise MlflowException("simulated: connection refused")
        return real(self, run_id, metrics, *a, **k)

    monkeypatch.setattr(MlflowClient, "log_batch", flaky)
    result = finetune(make_cfg(tiny, tmp_path / "flaky", report_to="mlflow"))
    assert result.state == "done" and result.global_step == 6
    err = capsys.readouterr().err
    assert "MLflow logging to" in err and "failed at step 2" in err and "training goes on" in err
    run = _only_run("flaky")
    assert run.status == "FINISHED"
    got = _mlflow(run.run_id, "loss")
    h = result.history.set_index("step")
    assert got == {s: h.loc[s, "loss"] for s in range(1, 7)}


@pytest.mark.timeout(300)
def test_on_two_engines_only_rank_0_writes(tiny, tmp_path, mlflow_store):
    import nbtrain

    out = tmp_path / "two"
    cfg = dict(model=tiny, data=DATA, output_dir=str(out), max_steps=4, logging_steps=1)
    cfg.update(per_device_train_batch_size=2, max_length=48, lora_r=8, report_to=BOTH)
    cluster = nbtrain.start(n=2, force=True)
    try:
        cluster.push({"cfg": cfg, "uri": mlflow_store})
        cluster.execute(
            "import os, nbtrain\n"
            "os.environ.update(MLFLOW_TRACKING_URI=uri, MLFLOW_EXPERIMENT_NAME='two-ranks')\n"
            "result = nbtrain.finetune(nbtrain.SFTConfig(**cfg))",
            live=False,
        )
        results = cluster.pull("result")
    finally:
        cluster.stop()
    h = results[0].history.set_index("step")
    run = _only_run("two-ranks")  # one run, not one per rank
    assert run.status == "FINISHED" and run["params.world_size"] == "2"
    assert _mlflow(run.run_id, "loss") == {s: h.loc[s, "loss"] for s in range(1, 5)}
    assert len(list((out / "runs").glob("events.out.tfevents.*"))) == 1
    assert sorted(_scalars(_tensorboard(out / "runs"), "train/loss")) == [1, 2, 3, 4]
