"""Run comparison (nbtrain/compare): the data layer on plain dicts and on two real tiny finetune runs
with different learning rates, and the drawing `nbtrain.compare` makes of them."""

from __future__ import annotations

import base64
import csv
import io
import json
import math
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import nbtrain
from nbtrain import plots
from nbtrain.compare import (
    IGNORED_FIELDS,
    config_diff,
    ema,
    labels,
    last_samples,
    load_run,
    load_samples,
    parse_rows,
    parse_samples,
    samples_by_step,
    series,
    series_csv,
    side_by_side,
)
from nbtrain.errors import NotARunError
from tests.conftest import LR_RATES as RATES

ROOT = Path(__file__).resolve().parents[2]
FIXTURE_RUN = ROOT / "tests" / "fixtures" / "runs" / "finished-sft"
PNG = b"\x89PNG\r\n\x1a\n"


def _ema_by_hand(values, w):
    """TensorBoard's scalar-card smoothing, written out: debiased EMA over the values so far."""
    out, acc = [], 0.0
    for i, v in enumerate(values, start=1):
        acc = w * acc + (1 - w) * v
        out.append(acc / (1 - w**i))
    return out


# ---- plain data --------------------------------------------------------------------------------


def test_config_diff_keeps_only_what_differs_in_run_order():
    a = {"learning_rate": 1e-3, "seed": 1, "lora_r": 8, "output_dir": "runs/a", "run_name": "a"}
    b = {"learning_rate": 1e-2, "seed": 1, "lora_r": 8, "output_dir": "runs/b", "run_name": "b"}
    c = {"learning_rate": 1e-2, "seed": 2, "output_dir": "runs/c", "resume": "latest"}
    assert config_diff([a, b]) == {"learning_rate": [1e-3, 1e-2]}
    # a field one config lacks is None there; fields that differ by design are never listed
    assert config_diff([a, b, c]) == {
        "learning_rate": [1e-3, 1e-2, 1e-2],
        "seed": [1, 1, 2],
        "lora_r": [8, 8, None],
    }
    assert {"output_dir", "resume", "run_name"} <= set(IGNORED_FIELDS)
    assert config_diff([a, dict(a)]) == {}
    assert config_diff([a, b], ignore=()) == {
        "learning_rate": [1e-3, 1e-2],
        "output_dir": ["runs/a", "runs/b"],
        "run_name": ["a", "b"],
    }
    # lists compare by value
    assert config_diff([{"t": ["q", "v"]}, {"t": ["q", "v"]}, {"t": ["q"]}]) == {
        "t": [["q", "v"], ["q", "v"], ["q"]]
    }


def test_ema_is_tensorboards_debiased_ema():
    assert ema([1.0, 2.0, 3.0, 4.0], 0.5) == pytest.approx([1.0, 5 / 3, 17 / 7, 49 / 15])
    values = [2.5, 2.1, 2.3, 1.7, 1.9, 1.2]
    assert ema(values, 0.9) == pytest.approx(_ema_by_hand(values, 0.9))
    assert ema(values, 0.0) == values
    assert ema([], 0.6) == []
    # the first smoothed value is the first value (debiased), not pulled towards 0
    assert ema([10.0, 10.5], 0.99)[0] == pytest.approx(10.0)
    # a constant series stays; a gap (None, NaN) is passed through and does not move the average
    assert ema([3.0, 3.0, 3.0], 0.6) == [3.0, 3.0, 3.0]
    gap = ema([1.0, None, 3.0], 0.5)
    assert (
        math.isnan(gap[1])
        and gap[0] == 1.0
        and gap[2] == pytest.approx(_ema_by_hand([1, 3], 0.5)[1])
    )
    for bad in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"in \[0, 1\)"):
            ema(values, bad)


def test_parse_rows_skips_bad_lines_and_reads_nan_as_none():
    lines = [
        '{"step": 1, "loss": 2.0}',
        '{"step": 2, "loss": NaN, "grad_norm": Infinity}',
        "not json",
        '{"loss": 1.0}',  # no step
        '["a list"]',
        "",
        '{"step": 3, "loss": 1.5',  # cut short by a crash
    ]
    assert parse_rows(lines) == [
        {"step": 1, "loss": 2.0},
        {"step": 2, "loss": None, "grad_norm": None},
    ]


def _sample(step, index, completion, prompt=None, reference=None):
    return json.dumps(
        {
            "step": step,
            "index": index,
            "prompt": prompt or f"prompt {index}",
            "completion": completion,
            "reference": reference,
            "tokens": 3,
            "seconds": 0.5,
        }
    )


def test_parse_samples_keeps_only_sample_rows():
    good = _sample(0, 1, "hi\nthere", reference="ref")
    lines = [
        good,
        '{"step": 0, "index": 0, "prompt": "p", "completion": "c", "tokens": true, "seconds": NaN}',
        '{"step": 1.5, "index": 0, "prompt": "p", "completion": "c"}',  # step not an int
        '{"step": 1, "index": 0, "prompt": "p"}',  # no completion
        '{"step": 1, "index": 0, "prompt": "p", "completion": 7}',
        '{"step": 1, "index": 0, "prompt": "p", "compl',  # cut short
        "[1]",
        "",
    ]
    # a completion cut inside a multi-byte character loses the replacement characters its
    # decoding left, not the rest
    cut = _sample(2, 0, "caf\u00e9 \u2603\ufffd\ufffd")
    assert parse_samples([cut])[0]["completion"] == "caf\u00e9 \u2603"
    assert parse_samples(lines) == [
        json.loads(good),
        {
            "step": 0,
            "index": 0,
            "prompt": "p",
            "completion": "c",
            "reference": None,
            "tokens": None,
            "seconds": None,
        },
    ]


def test_last_samples_by_step_and_side_by_side(tmp_path):
    rows = parse_samples(
        [
            _sample(0, 1, "b0"),
            _sample(0, 0, "a0"),
            _sample(10, 1, "b10"),
            _sample(10, 0, "a10"),
        ]
    )
    assert [r["completion"] for r in last_samples(rows)] == ["a10", "b10"]
    assert last_samples([]) == []
    assert [(s, [r["completion"] for r in rs]) for s, rs in samples_by_step(rows)] == [
        (10, ["a10", "b10"]),
        (0, ["a0", "b0"]),
    ]
    # a run folder without samples.jsonl sampled nothing
    assert load_samples(tmp_path) == [] and load_samples(tmp_path / "missing") == []

    run = load_run(FIXTURE_RUN)
    assert run.samples == []
    a = replace(run, samples=last_samples(rows))
    b = replace(
        run,
        samples=parse_samples(
            [
                _sample(4, 0, "other a", reference="gold"),
                _sample(4, 1, "only b", prompt="a prompt only b has"),
            ]
        ),
    )
    assert side_by_side([a, b]) == [
        {
            "prompt": "prompt 0",
            "reference": "gold",
            "completions": ["a10", "other a"],
            "steps": [10, 4],
        },
        {
            "prompt": "prompt 1",
            "reference": None,
            "completions": ["b10", None],
            "steps": [10, None],
        },
        {
            "prompt": "a prompt only b has",
            "reference": None,
            "completions": [None, "only b"],
            "steps": [None, 4],
        },
    ]


def test_load_run_says_which_folder_is_not_a_run(tmp_path):
    with pytest.raises(NotARunError, match=r"has no metrics\.jsonl") as info:
        load_run(tmp_path)
    assert str(tmp_path) in str(info.value)
    with pytest.raises(NotARunError, match="does not exist"):
        load_run(tmp_path / "missing")
    with pytest.raises(NotARunError, match="needs run folders"):
        nbtrain.compare([])


def test_an_old_run_without_config_or_time_loads(tmp_path):
    run = load_run(FIXTURE_RUN)
    assert run.name == "finished-sft" and run.config == {} and run.adapter is None
    assert len(run.rows) == 200 and run.final["step"] == 200 and run.final["loss"] == 0.958
    assert run.final["eval_loss"] == 1.038  # the last row that has one
    assert series([run], "loss", x="time") == [[]]
    with pytest.raises(ValueError, match="carry no time"):
        nbtrain.compare([FIXTURE_RUN, FIXTURE_RUN], x="time")
    with pytest.raises(ValueError, match="'step' or 'time'"):
        series([run], "loss", x="epoch")
    # two runs of one name get distinct labels
    assert labels([run, replace(run, path="/x/other/finished-sft")]) == [
        "runs/finished-sft",
        "other/finished-sft",
    ]


def test_compare_imports_cheaply():
    code = (
        "import sys, nbtrain; from nbtrain.compare import load_run, series; "
        "print(callable(nbtrain.compare), sorted(m for m in ('torch', 'matplotlib', 'pandas', "
        "'nbtrain.cluster') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True []"


# ---- two real runs (two_lr_runs, tests/conftest.py) --------------------------------------------


def test_a_run_folder_holds_its_config_and_a_time_per_row(two_lr_runs):
    for run in two_lr_runs["runs"]:
        out = Path(run["cfg"].output_dir)
        saved = json.loads((out / "sft_config.json").read_text())
        assert saved == json.loads(json.dumps(run["cfg"].to_dict(), default=str))
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        times = [r["time"] for r in rows]
        assert run["started"] <= times[0] and times[-1] <= run["ended"]
        assert times == sorted(times)
        # the history DataFrame carries it too
        assert list(run["result"].history["time"]) == times
    assert not list(Path(two_lr_runs["runs"][0]["cfg"].output_dir).glob(".*.tmp"))


def test_data_layer_on_two_real_runs(two_lr_runs):
    paths = [r["cfg"].output_dir for r in two_lr_runs["runs"]]
    runs = [load_run(p) for p in paths]
    assert [r.name for r in runs] == ["lr-0.01", "lr-0.001"]
    assert [r.path for r in runs] == [str(Path(p).resolve()) for p in paths]
    assert [r.state for r in runs] == ["done", "done"] and all(r.run_id for r in runs)
    assert runs[0].adapter == str(Path(paths[0]).resolve() / "adapter")
    # the only setting that differs is the one the test changed
    assert config_diff(runs) == {"learning_rate": list(RATES)}
    for run, done in zip(runs, two_lr_runs["runs"], strict=True):
        h = done["result"].history
        assert run.final["loss"] == pytest.approx(h["loss"].iloc[-1])
        assert run.final["eval_loss"] == pytest.approx(h["eval_loss"].dropna().iloc[-1])
        assert {"loss", "eval_loss", "tokens_per_s", "learning_rate"} <= set(run.metrics)

    loss = series(runs, "loss")
    assert [[x for x, _ in s] for s in loss] == [[1, 2, 3, 4, 5, 6]] * 2
    assert [y for _, y in loss[1]] == pytest.approx(
        list(two_lr_runs["runs"][1]["result"].history["loss"])
    )
    assert [[x for x, _ in s] for s in series(runs, "eval_loss")] == [[3, 6], [3, 6]]
    by_time = series(runs, "loss", x="time")
    for s, run in zip(by_time, runs, strict=True):
        xs = [x for x, _ in s]
        assert xs[0] == 0 and xs == sorted(xs)
        assert xs[-1] == pytest.approx(run.rows[-1]["time"] - run.rows[0]["time"])

    ys = [y for _, y in loss[0]]
    assert ema(ys, 0.6) == pytest.approx(_ema_by_hand(ys, 0.6))

    table = list(csv.DictReader(io.StringIO(series_csv(runs, ["loss", "eval_loss"], "step"))))
    assert [r["run"] for r in table] == ["lr-0.01"] * 6 + ["lr-0.001"] * 6
    assert float(table[7]["loss"]) == pytest.approx(runs[1].rows[1]["loss"])
    assert [r["eval_loss"] != "" for r in table[:6]] == [False, False, True, False, False, True]


def test_compare_draws_and_tables_two_real_runs(two_lr_runs, tmp_path):
    paths = [r["cfg"].output_dir for r in two_lr_runs["runs"]]
    plain = nbtrain.compare(paths)
    assert plain.metrics == ["loss", "eval_loss", "tokens_per_s", "learning_rate"]
    assert list(plain.diff.index) == ["learning_rate"]
    assert list(plain.diff.loc["learning_rate"]) == list(RATES)
    assert list(plain.table.index) == ["lr-0.01", "lr-0.001"]
    assert plain.table["adapter"].iloc[1] == str(Path(paths[1]).resolve() / "adapter")
    assert plain.table["loss"].iloc[0] == pytest.approx(load_run(paths[0]).final["loss"])
    assert plain.png().startswith(PNG)
    assert plain.notes == []

    page = plain._repr_html_()
    img = page.split('src="data:image/png;base64,', 1)[1].split('"', 1)[0]
    assert base64.b64decode(img).startswith(PNG)
    assert "learning_rate" in page and "lr-0.001" in page

    # one subplot per metric, each run a line with its name in the legend
    ax = plain.figure.axes[0]
    assert ax.get_title(loc="left") == "loss" and ax.get_ylabel() == "nats/token"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["lr-0.01", "lr-0.001"]
    drawn = [list(line.get_ydata()) for line in ax.lines]
    assert drawn == [[y for _, y in s] for s in series(plain.runs, "loss")]
    # issue 38, 8: each run in its Lab colour, the figure within the output area, transparent,
    # one x range for every chart, ticks ending each axis
    assert [line.get_color() for line in ax.lines] == [
        plots.run_colour(r.run_id) for r in plain.runs
    ]
    from PIL import Image

    img = Image.open(io.BytesIO(plain.png()))
    assert img.size[0] <= plots.MAX_WIDTH_PX and img.mode == "RGBA"
    assert img.getpixel((img.size[0] - 1, img.size[1] - 1))[3] == 0  # transparent
    shown = [a for a in plain.figure.axes if a.get_visible()]
    assert len({a.get_xlim() for a in shown}) == 1 and shown[0].get_xlim() == (1, 6)
    ymin, ymax = ax.get_ylim()
    assert ymin in ax.get_yticks() and ymax in ax.get_yticks()
    assert ymax >= max(max(d) for d in drawn)
    # the learning rate is never smoothed, and its ticks share one e-notation format
    lr_ax = shown[plain.metrics.index("learning_rate")]
    labels = [t.get_text() for t in lr_ax.get_yticklabels()]
    assert len({len(lbl.split("e")[0]) for lbl in labels if lbl != "0"}) == 1, labels

    smooth = nbtrain.compare(paths, smooth=0.8, logy=True)
    lr = smooth.curves["learning_rate"][0]
    assert lr.smoothed == lr.raw  # a schedule is drawn as it is
    ev = smooth.curves["eval_loss"][0]
    assert ev.smoothed == ev.raw  # eval loss is on 2 of the 6 rows: not smoothed
    ax = smooth.figure.axes[0]
    assert ax.get_yscale() == "log"
    raw_1, smooth_1 = (list(line.get_ydata()) for line in ax.lines[:2])
    assert raw_1 == drawn[0]  # the faint raw curve stays under the smoothed one
    assert ax.lines[0].get_alpha() < 1
    assert smooth_1 != raw_1 and smooth_1 == pytest.approx(_ema_by_hand(raw_1, 0.8))

    written = smooth.save(tmp_path / "report")
    assert Path(written["png"]).read_bytes().startswith(PNG)
    assert Path(written["csv"]).read_text() == smooth.csv()
    md = Path(written["md"]).read_text()
    assert "| learning_rate | 0.0100 | 1e-3 |" in md
    # the Lab's number format in the table: 3 significant digits, the step an integer
    page = smooth._repr_html_()
    final_loss = smooth.runs[0].final["loss"]
    assert f"<td>{plots.format_value(final_loss)}</td>" in page
    assert "<td>6</td>" in page and "6.0" not in page

    # a folder of run folders stands for all of them; one run is drawn, with a note
    assert nbtrain.compare(two_lr_runs["root"]).labels == ["lr-0.001", "lr-0.01"]
    one = nbtrain.compare(paths[0])
    assert one.notes and "two or more" in one.notes[0]
    with pytest.raises(ValueError, match="none of the runs logged mfu"):
        nbtrain.compare(paths, metrics=["mfu"])


def test_compare_shows_the_last_samples_side_by_side(two_lr_runs, tmp_path):
    paths = []
    for n, run in enumerate(two_lr_runs["runs"]):
        out = tmp_path / Path(run["cfg"].output_dir).name
        shutil.copytree(run["cfg"].output_dir, out)
        (out / "samples.jsonl").write_text(
            "\n".join(
                [
                    _sample(0, 0, "step zero"),
                    _sample(6, 1, f"run {n}: <b>bold</b>\nsecond line"),
                    _sample(6, 0, f"run {n}: 42", reference="12 + 30 = 42"),
                    _sample(6, 2, "  \n"),  # a model that wrote only blanks
                ]
            )
            + "\n"
        )
        paths.append(out)
    # a third run, one that sampled nothing, gets an empty column
    cmp = nbtrain.compare([*paths, two_lr_runs["runs"][0]["cfg"].output_dir])
    s = cmp.samples
    assert list(s.columns) == [
        "prompt",
        "reference",
        f"{tmp_path.name}/lr-0.01 (step 6)",
        "lr-0.001 (step 6)",
        "runs/lr-0.01 (step –)",
    ]
    assert list(s["prompt"]) == ["prompt 0", "prompt 1", "prompt 2"]
    assert list(s["reference"]) == ["12 + 30 = 42", None, None]
    assert list(s.iloc[:, 2]) == ["run 0: 42", "run 0: <b>bold</b>\nsecond line", "  \n"]
    assert list(s.iloc[:, 3]) == ["run 1: 42", "run 1: <b>bold</b>\nsecond line", "  \n"]
    assert list(s.iloc[:, 4]) == [None, None, None]

    page = cmp._repr_html_()
    # under the curves and the table, escaped, long text kept as written
    assert page.index("Last samples") > page.index("<img")
    assert "run 1: &lt;b&gt;bold&lt;/b&gt;\nsecond line" in page
    assert "<b>bold</b>" not in page and "pre-wrap" in page
    # blanks say so, twice (one per run that sampled); a run that did not sample has a dash
    assert page.count("(empty)</td>") == 2
    md = cmp.markdown()
    assert "## Last samples" in md
    assert (
        "| prompt 1 | – | run 0: <b>bold</b><br>second line | run 1: <b>bold</b><br>second line | – |"
        in md
    )

    # runs that sampled nothing: no samples table
    plain = nbtrain.compare([r["cfg"].output_dir for r in two_lr_runs["runs"]])
    assert plain.samples is None and "Last samples" not in plain._repr_html_()
