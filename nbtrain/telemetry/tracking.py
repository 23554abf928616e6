"""`SFTConfig(report_to=...)`: rank 0 sends the rows of the history to TensorBoard and MLflow, through
their own writers, as transformers' Trainer does (`TensorBoardCallback`, `MLflowCallback`).

In [1]: cfg = nbtrain.SFTConfig(..., report_to=["tensorboard", "mlflow"])

- TensorBoard: `torch.utils.tensorboard.SummaryWriter` in `logging_dir` (default `output_dir/runs`),
  tags `train/<column>` and `eval/loss` as transformers names them, the config as text.
- MLflow: the tracking store MLflow itself resolves (`MLFLOW_TRACKING_URI`, else MLflow 3's default,
  `sqlite:///mlflow.db` in rank 0's working folder), the experiment `MLFLOW_EXPERIMENT_NAME` (else
  MLflow's default one), the config as parameters, the columns as metrics by step, the exported
  adapter as the artifact `adapter/`. The run id is kept in `output_dir/mlflow_run.json`.
- Samples (`SFTConfig.sample_prompts`): TensorBoard gets each sampled step as a text table (tag
  `samples`); MLflow gets `samples.jsonl` as an artifact when the run ends.

A resumed run goes on in the same TensorBoard folder (the events after the checkpoint are purged, so
no step appears twice) and the same MLflow run (the steps it already has are not logged again).
Opening either fails the run's set-up, before any step; a writer that fails later warns and training
goes on (metrics.jsonl keeps every row); MLflow rows that could not be sent are retried, last at the end.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from nbtrain import atomic
from nbtrain.errors import ConfigError
from nbtrain.runs import MLFLOW_RUN_FILE

log = logging.getLogger(__name__)

REPORTERS = ("tensorboard", "mlflow")
RUN_FILE = MLFLOW_RUN_FILE
# after a failed send, MLflow rows wait this long before the next try (its client already retried)
RETRY_S = 60.0
_STATUS = {"done": "FINISHED", "stopped": "KILLED", "preempted": "KILLED", "failed": "FAILED"}


def installed(name: str) -> bool:
    """Whether `import name` would find the package (False where sys.modules marks it absent)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _missing(name: str) -> str:
    return (
        f"report_to={name!r} needs the {name} package, which is not installed on "
        f"{socket.gethostname()}: pip install {name} (or pip install 'nbtrain[{name}]')"
    )


def normalize_report_to(value: Any) -> tuple[list[str], list[str]]:
    """`report_to` as a list of reporters, and the problems with it (unknown names, missing packages).

    'none' is none; 'all' is every reporter whose package is installed, as in transformers."""
    if value is None or value == "none" or value == ["none"]:
        return [], []
    if value == "all" or value == ["all"]:
        return [r for r in REPORTERS if installed(r)], []
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
        msg = (
            f"report_to={value!r} must be 'none', 'all', 'tensorboard', 'mlflow' or a list of them"
        )
        return [], [msg]
    out: list[str] = []
    problems: list[str] = []
    for name in names:
        if name not in REPORTERS:
            problems.append(
                f"report_to: {name!r} is not supported; use 'none', 'all', 'tensorboard', "
                "'mlflow' or a list of them"
            )
        elif not installed(name):
            problems.append(_missing(name))
        elif name not in out:
            out.append(name)
    return out, problems


def _warn(msg: str) -> None:
    print(f"nbtrain: {msg}", file=sys.stderr, flush=True)


def _numbers(row: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in row.items()
        if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)
    }


def samples_markdown(rows: list[dict[str, Any]]) -> str:
    """One sampled step as a markdown table (TensorBoard's text tab renders markdown)."""

    def cell(value: Any) -> str:
        text = "" if value is None else str(value)
        return text.replace("|", "\\|").replace("\n", "<br>")

    has_ref = any(r.get("reference") is not None for r in rows)
    head = "| # | prompt | completion |" + (" reference |" if has_ref else "")
    rule = "|---|---|---|" + ("---|" if has_ref else "")
    lines = [head, rule]
    for r in rows:
        line = f"| {r['index']} | {cell(r['prompt'])} | {cell(r['completion'])} |"
        if has_ref:
            line += f" {cell(r.get('reference'))} |"
        lines.append(line)
    return "\n".join(lines)


class _TensorBoard:
    def __init__(self, cfg: Any, out: Path, history: list[dict[str, Any]], resumed_at: int | None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ConfigError(f"{_missing('tensorboard')} ({e})") from None
        default = os.environ.get("TENSORBOARD_LOGGING_DIR") or out / "runs"
        self.dir = Path(cfg.logging_dir or default).expanduser()
        going_on = resumed_at is not None and any(self.dir.glob("events.out.tfevents.*"))
        # purge_step: TensorBoard's readers drop the earlier events at or after this step, so the
        # steps a resumed run redoes (and a new run's steps) replace what was logged before
        self.writer = SummaryWriter(
            str(self.dir), purge_step=(resumed_at or 0) + 1 if going_on else 0
        )
        self.ok = True
        if not going_on:
            text = json.dumps(cfg.to_dict(), indent=2, default=str)
            # indented: TensorBoard's text tab renders markdown, and this shows as a code block
            self.writer.add_text("config", "\n".join("    " + x for x in text.splitlines()), 0)
            for row in history:  # a resumed run that had no TensorBoard before
                self.row(row)
        print(f"nbtrain: TensorBoard events in {self.dir} (tensorboard --logdir {self.dir})")

    def row(self, row: dict[str, Any]) -> None:
        if not self.ok:
            return
        try:
            for key, value in _numbers(row).items():
                # transformers' names: eval_loss is eval/loss, the rest train/<column>
                tag = "eval/" + key[5:] if key.startswith("eval_") else "train/" + key
                self.writer.add_scalar(tag, value, row["step"])
            self.writer.flush()
        except Exception as e:  # said by _warn: training goes on without TensorBoard
            self.ok = False
            _warn(
                f"TensorBoard writing to {self.dir} failed at step {row['step']} ({e}); training "
                "goes on without it, and every row is in metrics.jsonl"
            )

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        if not self.ok:
            return
        try:
            self.writer.add_text("samples", samples_markdown(rows), step)
            self.writer.flush()
        except Exception as e:  # said by _warn: the rows are in metrics.jsonl all the same
            _warn(
                f"TensorBoard: the samples of step {step} could not be written to {self.dir} ({e})"
            )

    def finish(self, state: str) -> None:
        try:
            self.writer.close()
        except Exception as e:  # said by _warn: the run itself has ended
            _warn(f"TensorBoard: closing {self.dir} failed ({e})")


class _MLflow:
    def __init__(
        self,
        cfg: Any,
        out: Path,
        name: str,
        history: list[dict[str, Any]],
        resumed_at: int | None,
        world: int,
    ):
        try:
            import mlflow
            from mlflow.tracking import MlflowClient
        except ImportError as e:
            raise ConfigError(f"{_missing('mlflow')} ({e})") from None
        self.out = out
        self.pending: list[Any] = []
        self.retry_at = 0.0
        self.last_step = 0  # the run's last step already in MLflow: not logged again
        run_file = out / RUN_FILE
        saved = None
        if resumed_at is not None and run_file.is_file():
            saved = json.loads(run_file.read_text())
        # a resumed run stays in the store it started in, whatever the working folder is now
        self.uri = saved["tracking_uri"] if saved else mlflow.get_tracking_uri()
        self.client = MlflowClient(tracking_uri=self.uri)
        try:
            run_id = self._continue(saved) if saved else None
            if run_id is None:
                run_id = self._new_run(cfg, name, world)
        except Exception as e:
            msg = (
                f"report_to='mlflow': the MLflow tracking store {self.uri} failed on "
                f"{socket.gethostname()} ({type(e).__name__}: {e}); start it or set "
                "MLFLOW_TRACKING_URI to one that works, or drop 'mlflow' from report_to"
            )
            raise ConfigError(msg) from e
        self.run_id: str = run_id
        atomic.write_json(run_file, {"run_id": self.run_id, "tracking_uri": self.uri})
        # rows a new run lacks (a resume that had no MLflow run before) are sent with the first row
        self.pending = [r for r in history if r["step"] > self.last_step]
        print(f"nbtrain: MLflow run {self.run_id} at {self.uri}")

    def _continue(self, saved: dict[str, Any]) -> str | None:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(saved["run_id"])
        except MlflowException as e:
            if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            _warn(f"MLflow run {saved['run_id']} is gone from {self.uri}; starting a new one")
            return None
        history = self.client.get_metric_history(saved["run_id"], "loss")
        self.last_step = max((m.step for m in history), default=0)
        self.client.update_run(saved["run_id"], status="RUNNING")
        return str(saved["run_id"])

    def _new_run(self, cfg: Any, name: str, world: int) -> str:
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME")
        exp_id = "0"  # MLflow's default experiment
        if experiment:
            found = self.client.get_experiment_by_name(experiment)
            exp_id = found.experiment_id if found else self.client.create_experiment(experiment)
        tags = json.loads(os.environ.get("MLFLOW_TAGS") or "{}")
        tags["nbtrain.output_dir"] = str(self.out.resolve())
        run_id = str(self.client.create_run(exp_id, run_name=name, tags=tags).info.run_id)
        params = {**cfg.to_dict(), "world_size": world}
        # MLflow keeps parameters as strings of at most MAX_PARAM_VAL_LENGTH characters
        values = [Param(k, str(v)[:MAX_PARAM_VAL_LENGTH]) for k, v in params.items()]
        for i in range(0, len(values), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(run_id, params=values[i : i + MAX_PARAMS_TAGS_PER_BATCH])
        return run_id

    def row(self, row: dict[str, Any]) -> None:
        if row["step"] <= self.last_step:
            return
        self.pending.append(row)
        if time.monotonic() >= self.retry_at:
            self._send(final=False)

    def _send(self, final: bool) -> None:
        from mlflow.entities import Metric

        if not self.pending:
            return
        now = int(time.time() * 1000)
        metrics = [
            Metric(k, v, now, r["step"])
            for r in self.pending
            for k, v in _numbers(r).items()
            if math.isfinite(v)
        ]
        try:
            for i in range(0, len(metrics), 1000):  # MLflow's limit per batch
                self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])
        except Exception as e:  # kept for the next try, or said by _warn at the end
            steps = f"steps {self.pending[0]['step']}..{self.pending[-1]['step']}"
            if final:
                _warn(
                    f"MLflow: {steps} could not be sent to run {self.run_id} at {self.uri} "
                    f"({e}); they are in {self.out / 'metrics.jsonl'}"
                )
            elif self.retry_at == 0.0:
                _warn(
                    f"MLflow logging to {self.uri} failed at step {self.pending[-1]['step']} "
                    f"({e}); training goes on, every row is in metrics.jsonl, and the rows not "
                    "sent are tried again (last when the run ends)"
                )
            self.retry_at = time.monotonic() + RETRY_S
            return
        self.last_step = self.pending[-1]["step"]
        self.pending = []
        self.retry_at = 0.0

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Nothing per step: the whole samples.jsonl is sent when the run ends."""

    def finish(self, state: str) -> None:
        from nbtrain.runs import ADAPTER_DIR, SAMPLES_FILE

        self._send(final=True)
        adapter = self.out / ADAPTER_DIR
        try:
            if (self.out / SAMPLES_FILE).is_file():
                self.client.log_artifact(self.run_id, str(self.out / SAMPLES_FILE))
            if state != "failed" and adapter.is_dir():
                self.client.log_artifacts(self.run_id, str(adapter), artifact_path=ADAPTER_DIR)
            self.client.set_terminated(self.run_id, _STATUS.get(state, "FAILED"))
        except Exception as e:  # said by _warn: the run itself has ended
            _warn(f"MLflow: ending run {self.run_id} at {self.uri} failed ({e})")


class Trackers:
    """Rank 0's reporters (`report_to`), fed the same rows as metrics.jsonl."""

    def __init__(self, reporters: list[Any]):
        self.reporters = reporters

    def row(self, row: dict[str, Any]) -> None:
        for r in self.reporters:
            r.row(row)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        for r in self.reporters:
            r.samples(step, rows)

    def finish(self, state: str) -> None:
        for r in self.reporters:
            r.finish(state)


def open_trackers(
    cfg: Any,
    out: Path,
    name: str,
    world: int,
    resumed_at: int | None,
    history: list[dict[str, Any]],
) -> Trackers | None:
    """Rank 0: open every reporter of `cfg.report_to` (None when there are none); ConfigError when
    one cannot be opened. MLflow opens first, so a store that fails leaves output_dir untouched.

    `resumed_at`: the checkpoint's step on a resume; `history`: the rows up to it."""
    if not cfg.report_to:
        return None
    reporters: list[Any] = []
    if "mlflow" in cfg.report_to:
        reporters.append(_MLflow(cfg, out, name, history, resumed_at, world))
    if "tensorboard" in cfg.report_to:
        reporters.append(_TensorBoard(cfg, out, history, resumed_at))
    return Trackers(reporters)
