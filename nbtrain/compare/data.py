"""Run comparison, the data side: load run folders, the settings that differ, curves, smoothing, CSV.

Files only: no cluster, no display, no torch, so the Jupyter server can use it as well as a notebook.

In [1]: from nbtrain.compare import load_run, config_diff, series
In [2]: runs = [load_run("runs/lr-1e-3"), load_run("runs/lr-1e-2")]
In [3]: config_diff(runs)
Out[3]: {'learning_rate': [0.001, 0.01]}

A run folder is what `finetune` writes to its `output_dir`: ``metrics.jsonl`` (one row per logged step,
with its wall-clock ``time``), ``sft_config.json`` (the run's settings), ``adapter/`` and, when it sampled
during training, ``samples.jsonl`` (a completion per prompt and sampled step). `nbtrain.compare()`
(`nbtrain.compare.view`) draws the comparison in a notebook, the JupyterLab sidebar in the browser.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nbtrain.errors import NotARunError
from nbtrain.runs import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_DIR,
    CONFIG_FILE,
    METRICS_FILE,
    SAMPLES_FILE,
)

log = logging.getLogger(__name__)

#: the curves a comparison draws by default
COMPARE_METRICS = ("loss", "eval_loss", "tokens_per_s", "learning_rate")
#: settings that differ between any two runs by design (where they write, whether they resume), so a
#: config diff leaves them out
IGNORED_FIELDS = ("output_dir", "logging_dir", "resume", "resume_from", "overwrite", "run_name")
#: what the x axis of a curve can be: the optimizer step, or seconds since the run's first row
X_AXES = ("step", "time")
# row keys that are not metrics of the run's end
_NOT_FINAL = ("time",)


@dataclass
class RunData:
    """One run folder, read: its name, settings, metric rows, last values and adapter."""

    name: str  #: the run's name (registry record name, else folder name)
    path: str  #: resolved output_dir
    config: dict[str, Any]  #: the SFTConfig as saved in output_dir/sft_config.json ({} if absent)
    rows: list[dict[str, Any]]  #: metrics.jsonl rows (bad lines skipped, NaN/inf read as None)
    final: dict[str, Any]  #: the last value of each metric (loss, eval_loss, tokens_per_s, ...)
    adapter: str | None  #: output_dir/adapter if it holds an exported adapter
    run_id: str | None = None  #: the runs-registry id, when the run is registered
    state: str | None = None  #: running, done, failed, stopped or preempted (registry), else None
    metrics: list[str] = field(
        default_factory=list
    )  #: metric names in the rows, in first-seen order
    samples: list[dict[str, Any]] = field(
        default_factory=list
    )  #: the completions of the last sampled step (samples.jsonl), in prompt order
    kind: str = "sft"  #: what the run trained: sft, dpo or grpo (`run_kind`)


def run_kind(record: dict[str, Any] | None, config: dict[str, Any]) -> str:
    """sft, dpo or grpo: the registry record's kind, else told from the saved config's own fields (a
    folder whose record is gone or was written before records had kinds)."""
    from nbtrain.runs import RUN_KINDS

    kind = (record or {}).get("kind")
    if kind in RUN_KINDS:
        return str(kind)
    if "num_generations" in config:
        return "grpo"
    if "precompute_ref_log_probs" in config:
        return "dpo"
    return "sft"


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def json_rows(lines: Iterable[str | bytes]) -> Iterator[dict[str, Any]]:
    """The JSON objects of a JSON-lines file's lines; blank lines, a line cut short by a crash and
    anything not an object are skipped."""
    for line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            yield row


def parse_rows(lines: Iterable[str | bytes]) -> list[dict[str, Any]]:
    """Metric rows from metrics.jsonl lines, as the server reads them: a line cut short by a crash or
    without a numeric ``step`` is skipped, NaN and infinities become None."""
    rows = []
    for row in json_rows(lines):
        step = row.get("step")
        if isinstance(step, bool) or not isinstance(step, int | float):
            continue
        rows.append({k: _finite(v) for k, v in row.items()})
    return rows


def parse_samples(lines: Iterable[str | bytes]) -> list[dict[str, Any]]:
    """Sample rows from samples.jsonl lines (`SAMPLES_FILE`), in file order. A row needs an integer
    ``step`` and ``index`` and a string ``prompt`` and ``completion``; others (a line cut short by a
    crash) are skipped. ``reference`` is a string or None, ``tokens`` and ``seconds`` numbers or None."""
    rows = []
    for row in json_rows(lines):
        step, index = row.get("step"), row.get("index")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (step, index)):
            continue
        if not isinstance(row.get("prompt"), str) or not isinstance(row.get("completion"), str):
            continue
        reference = row.get("reference")
        tokens, seconds = row.get("tokens"), row.get("seconds")
        rows.append(
            {
                "step": step,
                "index": index,
                "prompt": row["prompt"],
                "completion": clean_completion(row["completion"]),
                "reference": reference if isinstance(reference, str) else None,
                "tokens": tokens
                if isinstance(tokens, int) and not isinstance(tokens, bool)
                else None,
                "seconds": _finite(float(seconds))
                if isinstance(seconds, int | float) and not isinstance(seconds, bool)
                else None,
            }
        )
    return rows


def clean_completion(text: str) -> str:
    """A completion without the U+FFFD replacement characters at its end: a sample cut at its token
    limit inside a multi-byte character decodes to them, and the character is not there to show
    (the blanks a model wrote stay: `nbtrain.plots.completion_text` writes those "(empty)")."""
    return text.rstrip("\ufffd")


def load_samples(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every sample row of a run folder's samples.jsonl ([] when the run sampled nothing)."""
    try:
        with open(Path(path) / SAMPLES_FILE, "rb") as f:
            return parse_samples(f)
    except (FileNotFoundError, NotADirectoryError):
        return []


def last_samples(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of the newest sampled step, one per prompt in prompt order (a prompt sampled twice at
    that step keeps its last row)."""
    if not rows:
        return []
    last = max(r["step"] for r in rows)
    by_index = {r["index"]: r for r in rows if r["step"] == last}
    return [by_index[i] for i in sorted(by_index)]


def samples_by_step(rows: Sequence[dict[str, Any]]) -> list[tuple[int, list[dict[str, Any]]]]:
    """The sample rows grouped by step, newest step first, each step's rows in prompt order."""
    steps: dict[int, dict[int, dict[str, Any]]] = {}
    for r in rows:
        steps.setdefault(r["step"], {})[r["index"]] = r
    return [(s, [steps[s][i] for i in sorted(steps[s])]) for s in sorted(steps, reverse=True)]


def side_by_side(runs: Sequence[RunData]) -> list[dict[str, Any]]:
    """The runs' last samples matched by prompt: one entry per prompt (in the first run's prompt
    order, then prompts only later runs sampled), each {"prompt", "reference", "completions": [one
    per run, None where that run did not sample the prompt], "steps": [the step of each]}."""
    out: dict[str, dict[str, Any]] = {}
    for r, run in enumerate(runs):
        for row in run.samples:
            entry = out.setdefault(
                row["prompt"],
                {
                    "prompt": row["prompt"],
                    "reference": None,
                    "completions": [None] * len(runs),
                    "steps": [None] * len(runs),
                },
            )
            entry["reference"] = entry["reference"] or row["reference"]
            entry["completions"][r] = row["completion"]
            entry["steps"][r] = row["step"]
    return list(out.values())


def final_values(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The last number of each key in `rows` (every metric, and the step), except the row's
    wall-clock time; text and booleans are not metrics and are left out."""
    final: dict[str, Any] = {}
    for row in rows:
        for key, value in row.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                if key not in _NOT_FINAL:
                    final[key] = value
    return final


def _registry_record(folder: Path) -> dict[str, Any] | None:
    try:
        from nbtrain.runs import get_run, run_id_for

        return get_run(run_id_for(folder))
    except OSError:  # an unwritable nbtrain home: the folder name will do
        return None


def _registered_folder(ref: str) -> Path | None:
    """The output_dir of a registered run whose id, or unique name, is `ref`."""
    try:
        from nbtrain.runs import list_runs

        records = list_runs()
    except OSError:
        return None
    by_id = [r for r in records if r.get("id") == ref]
    by_name = [r for r in records if r.get("name") == ref]
    found = by_id or (by_name if len(by_name) == 1 else [])
    return Path(found[0]["output_dir"]) if found and found[0].get("output_dir") else None


def load_run(path: str | os.PathLike[str]) -> RunData:
    """Read one run folder (a `finetune` output_dir); a registered run's id or name also works.

    In [1]: run = load_run("runs/first")
    In [2]: run.final["loss"], run.config["learning_rate"]
    """
    folder = Path(path).expanduser()
    if not folder.exists() and isinstance(path, str):
        folder = _registered_folder(path) or folder
    if not folder.is_dir():
        what = "is a file" if folder.exists() else "does not exist"
        msg = (
            f"{os.fspath(path)!r} {what}: a run is the output_dir folder a finetune run wrote "
            f"(holding {METRICS_FILE}); pass that folder"
        )
        raise NotARunError(msg)
    folder = folder.resolve()
    metrics = folder / METRICS_FILE
    if not metrics.is_file():
        msg = (
            f"{folder} is not a run folder: it has no {METRICS_FILE}, which finetune writes to its "
            "output_dir from the first logged step; pass the output_dir of a finetune run"
        )
        raise NotARunError(msg)
    with open(metrics, "rb") as f:
        rows = parse_rows(f)
    config: dict[str, Any] = {}
    config_file = folder / CONFIG_FILE
    if config_file.is_file():
        try:
            loaded = json.loads(config_file.read_text())
        except ValueError:
            loaded = None
        if isinstance(loaded, dict):
            config = loaded
    adapter = folder / ADAPTER_DIR
    record = _registry_record(folder)
    names: dict[str, None] = {}
    for row in rows:
        names.update(dict.fromkeys(k for k in row if k not in ("step", "time")))
    return RunData(
        name=(record or {}).get("name") or config.get("run_name") or folder.name,
        path=str(folder),
        config=config,
        rows=rows,
        final=final_values(rows),
        adapter=str(adapter) if (adapter / ADAPTER_CONFIG_FILE).is_file() else None,
        run_id=(record or {}).get("id"),
        state=(record or {}).get("state"),
        metrics=list(names),
        samples=last_samples(load_samples(folder)),
        kind=run_kind(record, config),
    )


def load_runs(paths: Iterable[str | os.PathLike[str]]) -> list[RunData]:
    """`load_run` of each path, in order."""
    return [load_run(p) for p in paths]


def labels(runs: Sequence[RunData]) -> list[str]:
    """A distinct label per run for legends and tables: its name, with its parent folder where two
    runs share a name, and a number where even that is not enough."""
    names = [r.name for r in runs]
    out = []
    for run, name in zip(runs, names, strict=True):
        if names.count(name) > 1:
            parent = Path(run.path).parent.name
            name = f"{parent}/{name}" if parent else name
        out.append(name)
    seen: dict[str, int] = {}
    for i, name in enumerate(out):
        if out.count(name) > 1:
            seen[name] = seen.get(name, 0) + 1
            out[i] = f"{name} ({seen[name]})"
    return out


def _config(run: RunData | dict[str, Any]) -> dict[str, Any]:
    return run.config if isinstance(run, RunData) else run


def config_diff(
    runs: Sequence[RunData | dict[str, Any]], ignore: Iterable[str] = IGNORED_FIELDS
) -> dict[str, list[Any]]:
    """The settings whose values differ between `runs`, each with its values in run order.

    A field one run's config lacks counts as None there. Fields in `ignore` (where a run writes,
    whether it resumed: they differ by design) are left out. Plain config dicts work too.

    In [1]: config_diff([{"learning_rate": 1e-3, "seed": 1}, {"learning_rate": 1e-2, "seed": 1}])
    Out[1]: {'learning_rate': [0.001, 0.01]}
    """
    configs = [_config(r) for r in runs]
    skip = set(ignore)
    keys: dict[str, None] = {}
    for cfg in configs:
        keys.update(dict.fromkeys(k for k in cfg if k not in skip))
    diff: dict[str, list[Any]] = {}
    for key in keys:
        values = [cfg.get(key) for cfg in configs]
        if any(v != values[0] for v in values[1:]):
            diff[key] = values
    return diff


def _x_of(x: str) -> None:
    if x not in X_AXES:
        msg = f"x={x!r}: a curve's x axis is 'step' or 'time' (seconds since the run's first row)"
        raise ValueError(msg)


def _points(run: RunData, metric: str, x: str) -> list[tuple[float, float]]:
    t0 = next((r["time"] for r in run.rows if isinstance(r.get("time"), int | float)), None)
    points = []
    for row in run.rows:
        y = row.get(metric)
        if isinstance(y, bool) or not isinstance(y, int | float):
            continue
        if x == "step":
            points.append((float(row["step"]), float(y)))
        elif t0 is not None and isinstance(row.get("time"), int | float):
            points.append((float(row["time"] - t0), float(y)))
    return points


def series(
    runs: Sequence[RunData], metric: str, x: str = "step"
) -> list[list[tuple[float, float]]]:
    """Per run, the (x, value) points of `metric`: rows without a value for it are left out.

    `x="time"` is seconds since the run's first row; rows written before nbtrain logged a time (or
    by a loop of your own that does not) have none and are left out.
    """
    _x_of(x)
    return [_points(run, metric, x) for run in runs]


def has_time(run: RunData) -> bool:
    """Whether the run's rows carry a wall-clock time (so it can be drawn against time)."""
    return any(isinstance(r.get("time"), int | float) for r in run.rows)


def ema(values: Sequence[float | None], weight: float) -> list[float]:
    """Smooth `values` as TensorBoard's scalar card does: an exponential moving average, debiased.

    smoothed_i = last_i / (1 - weight**n_i), where last_i = weight * last_{i-1} + (1 - weight) * v_i
    and n_i counts the finite values so far; a value that is not finite (None, NaN) is passed through
    and does not move the average, and a constant series stays as it is. `weight` 0 is no smoothing.
    """
    if not 0.0 <= weight < 1.0:
        msg = f"smoothing weight {weight!r}: pass a number in [0, 1) (0 = none, 0.6 = TensorBoard's default)"
        raise ValueError(msg)
    vals = [math.nan if v is None else float(v) for v in values]
    if not vals:
        return []
    finite = [v for v in vals if math.isfinite(v)]
    if weight == 0 or all(v == vals[0] for v in vals) or not finite:
        return vals
    last, n, out = 0.0, 0, []
    for v in vals:
        if not math.isfinite(v):
            out.append(v)
            continue
        last = last * weight + (1 - weight) * v
        n += 1
        out.append(last / (1 - weight**n))
    return out


def series_csv(
    runs: Sequence[RunData], metrics: Sequence[str] = COMPARE_METRICS, x: str = "step"
) -> str:
    """The runs' curves as CSV: one line per run and logged row, columns run, x, then each metric
    (empty where that row has no value). Rows with none of `metrics` are left out."""
    _x_of(x)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["run", x, *metrics])
    for label, run in zip(labels(runs), runs, strict=True):
        t0 = next((r["time"] for r in run.rows if isinstance(r.get("time"), int | float)), None)
        for row in run.rows:
            values = [row.get(m) for m in metrics]
            if all(v is None for v in values):
                continue
            if x == "step":
                xv: Any = row["step"]
            elif t0 is not None and isinstance(row.get("time"), int | float):
                xv = round(row["time"] - t0, 3)
            else:
                continue
            w.writerow([label, xv, *("" if v is None else v for v in values)])
    return buf.getvalue()


__all__ = [
    "COMPARE_METRICS",
    "IGNORED_FIELDS",
    "RunData",
    "clean_completion",
    "config_diff",
    "ema",
    "labels",
    "last_samples",
    "load_run",
    "load_runs",
    "load_samples",
    "parse_samples",
    "samples_by_step",
    "series",
    "series_csv",
    "side_by_side",
]
