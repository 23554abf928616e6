"""`nbtrain.compare([...])`: runs drawn over each other as one static image, and their differences as a table.

In [1]: cmp = nbtrain.compare(["runs/lr-1e-3", "runs/lr-1e-2"], smooth=0.6)
In [2]: cmp.diff          # the settings that differ, one column per run
In [3]: cmp.samples       # the runs' last samples side by side, one row per prompt (when they sampled)
In [4]: cmp.save("report")  # compare.png, compare.csv and compare.md

The image is a PNG inside the cell's HTML output, so a saved or shared notebook shows the comparison
without the JupyterLab extension (whose sidebar draws the same curves live).
"""

from __future__ import annotations

import base64
import html
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nbtrain import atomic
from nbtrain.compare.data import (
    COMPARE_METRICS,
    METRICS_FILE,
    RunData,
    config_diff,
    ema,
    has_time,
    labels,
    load_run,
    series,
    series_csv,
    side_by_side,
)
from nbtrain.errors import NotARunError
from nbtrain.plots import (
    RAW_ALPHA,
    completion_text,
    format_cell,
    legend,
    new_figure,
    nice_ticks,
    overview,
    png_bytes,
    run_colour,
    smoothed,
    style_axes,
    unit,
)
from nbtrain.runs import run_id_for

log = logging.getLogger(__name__)

#: the last values a comparison's table shows, where any run has them
FINAL_COLUMNS = ("step", "loss", "eval_loss", "grad_norm", "tokens_per_s", "mfu", "peak_memory_gb")
#: drawn after the overview of the runs' kind, where the runs have them
ALWAYS_DRAWN = ("tokens_per_s", "learning_rate")


def _expand(runs: Any) -> list[RunData]:
    """RunData from paths (or RunData); a folder holding run folders stands for all of them."""
    if isinstance(runs, str | os.PathLike | RunData):
        runs = [runs]
    out: list[RunData] = []
    for item in runs:
        if isinstance(item, RunData):
            out.append(item)
            continue
        folder = Path(item).expanduser()
        if folder.is_dir() and not (folder / METRICS_FILE).is_file():
            inside = sorted(p for p in folder.iterdir() if (p / METRICS_FILE).is_file())
            if inside:
                out.extend(load_run(p) for p in inside)
                continue
        out.append(load_run(item))
    return out


@dataclass
class Curve:
    """One run's curve of one metric, as drawn."""

    run: str
    x: list[float]
    raw: list[float]
    smoothed: list[float]


@dataclass
class Comparison:
    """What `nbtrain.compare` returns: shown as the image and table, or saved with `.save(folder)`."""

    runs: list[RunData]
    labels: list[str]
    metrics: list[str]  #: the metrics drawn (those of the asked-for metrics that any run has)
    x: str
    smooth: float
    diff: (
        Any  #: pandas DataFrame: the settings that differ, one row per setting, one column per run
    )
    table: Any  #: pandas DataFrame: one row per run, its differing settings, last metrics, adapter
    figure: Any  #: the matplotlib Figure
    curves: dict[str, list[Curve]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: pandas DataFrame: the runs' last samples side by side (prompt, reference, one column per run),
    #: one row per prompt; None when no run sampled during training
    samples: Any = None

    def png(self) -> bytes:
        """The figure as PNG bytes, on a transparent background (the notebook's theme shows)."""
        return png_bytes(self.figure)

    def csv(self) -> str:
        """Every run's curves as CSV: columns run, x, then each metric."""
        return series_csv(self.runs, self.metrics, self.x)

    def markdown(self) -> str:
        """The table as Markdown, one column per run."""
        t = self.table.T
        head = ["", *map(str, t.columns)]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for name, row in t.iterrows():
            cells = [str(name), *(_fmt(v, str(name)) for v in row)]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        return "\n".join(lines) + "\n" + self._samples_markdown()

    def _samples_markdown(self) -> str:
        if self.samples is None:
            return ""
        head = ["prompt", *map(str, self.samples.columns[1:])]
        lines = [
            "\n## Last samples\n",
            "| " + " | ".join(head) + " |",
            "|" + "---|" * len(head),
        ]
        for _, row in self.samples.iterrows():
            cells = [_text(v) for v in row]
            lines.append(
                "| " + " | ".join(c.replace("|", "\\|").replace("\n", "<br>") for c in cells) + " |"
            )
        return "\n".join(lines) + "\n"

    def save(self, folder: str | os.PathLike[str]) -> dict[str, str]:
        """Write compare.png, compare.csv and compare.md into `folder` (each file whole or not at all)."""
        out = Path(folder).expanduser()
        out.mkdir(parents=True, exist_ok=True)
        notes = "".join(f"\n> {n}\n" for n in self.notes)
        body = {
            "compare.png": self.png(),
            "compare.csv": self.csv().encode(),
            "compare.md": (
                f"# {' vs '.join(self.labels)}\n\n![curves](compare.png)\n{notes}\n"
                + self.markdown()
            ).encode(),
        }
        written = {}
        for name, data in body.items():
            atomic.write_bytes(out / name, data)
            written[name.rsplit(".", 1)[1]] = str(out / name)
        return written

    def _repr_html_(self) -> str:
        img = base64.b64encode(self.png()).decode()
        notes = "".join(f"<p><i>{html.escape(n)}</i></p>" for n in self.notes)
        table = _shown(self.table).to_html(escape=True)
        return f'<div><img src="data:image/png;base64,{img}"/>{notes}{table}{self._samples_html()}</div>'

    def _samples_html(self) -> str:
        """The last samples side by side: a column per run, long text wrapped as written."""
        if self.samples is None:
            return ""
        cell = (
            "text-align:left;vertical-align:top;white-space:pre-wrap;overflow-wrap:anywhere;"
            "padding:4px 8px;border-bottom:1px solid rgba(128,128,128,.3)"
        )
        # the prompt and the reference narrow, the completions (what is compared) share the rest
        widths = {"prompt": "24%", "reference": "12%"}
        head = "".join(
            f'<th style="{cell};width:{widths.get(str(c), "auto")}">{html.escape(str(c))}</th>'
            for c in self.samples.columns
        )
        body = "".join(
            "<tr>" + "".join(_sample_cell(cell, v) for v in row) + "</tr>"
            for _, row in self.samples.iterrows()
        )
        return (
            '<h4 style="margin:12px 0 4px">Last samples</h4>'
            '<table class="nbtrain-samples" style="width:100%;table-layout:fixed;border-collapse:collapse">'
            f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
        )

    def __repr__(self) -> str:
        return f"Comparison({', '.join(self.labels)}; metrics={self.metrics}, x={self.x!r})"


def _sample_cell(style: str, value: Any) -> str:
    """A samples table cell: the text escaped, a muted "(empty)" where the model wrote only blanks."""
    text = _text(value)
    if isinstance(value, str) and not value.strip():
        return f'<td style="{style};opacity:.6;font-style:italic">(empty)</td>'
    return f'<td style="{style}">{html.escape(text)}</td>'


def _text(value: Any) -> str:
    """A samples table cell: the text, "(empty)" where the model wrote only blanks, or a dash
    where the run did not sample that prompt."""
    return completion_text(value) if isinstance(value, str) else "–"


def _fmt(value: Any, key: str = "") -> str:
    """A table cell as the Lab writes it (`nbtrain.plots.format_cell`): 4.85, 3.22k, 1.5e-5, a step
    as an integer, a time as a date; text as it is."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return format_cell(key.removeprefix("final "), value)
    return str(value)


def _shown(table: Any) -> Any:
    """The table as its cells are written: a row per column of `table` (setting or metric), a
    column per run."""
    import pandas as pd

    t = table.T
    cells = [[_fmt(v, str(name)) for v in row] for name, row in t.iterrows()]
    return pd.DataFrame(cells, index=t.index, columns=t.columns)


def _tables(runs: list[RunData], names: list[str]) -> tuple[Any, Any]:
    import pandas as pd

    diff = config_diff(runs)
    diff_df = pd.DataFrame(
        {name: [diff[k][i] for k in diff] for i, name in enumerate(names)}, index=list(diff)
    )
    finals = [c for c in FINAL_COLUMNS if any(c in r.final for r in runs)]
    # a setting and a last metric of the same name stay two columns
    named = {c: f"final {c}" if c in diff else c for c in finals}
    table = pd.DataFrame(
        [
            {
                **{k: diff[k][i] for k in diff},
                **{named[c]: run.final.get(c) for c in finals},
                "adapter": run.adapter,
            }
            for i, run in enumerate(runs)
        ],
        index=names,
    )
    return diff_df, table


def _samples(runs: list[RunData], names: list[str]) -> Any:
    """The runs' last samples side by side, or None when none of them sampled."""
    import pandas as pd

    matched = side_by_side(runs)
    if not matched:
        return None
    cols = [
        f"{name} (step {max((e['steps'][i] for e in matched if e['steps'][i] is not None), default='–')})"
        for i, name in enumerate(names)
    ]
    data = []
    for e in matched:
        data.append([e["prompt"], e["reference"], *e["completions"]])
    frame = pd.DataFrame(data, columns=["prompt", "reference", *cols], dtype=object)
    if all(e["reference"] is None for e in matched):
        frame = frame.drop(columns="reference")
    return frame


def default_metrics(runs: Sequence[RunData]) -> list[str]:
    """What a comparison draws unless told: the Lab's overview of the runs' kind (SFT's loss and
    eval loss; DPO's reward margin and accuracy; GRPO's rewards, completion length, KL), then
    throughput and the learning rate; COMPARE_METRICS where the runs are of several kinds."""
    kinds = {r.kind for r in runs}
    if len(kinds) != 1:
        return list(COMPARE_METRICS)
    keys = [k for r in runs for k in r.metrics]
    shown = [k for chart in overview(kinds.pop(), keys) for k in chart.keys]
    return list(dict.fromkeys([*shown, *ALWAYS_DRAWN]))


def compare(
    runs: Any,
    metrics: Sequence[str] | None = None,
    x: str = "step",
    smooth: float = 0.0,
    logy: bool = False,
) -> Comparison:
    """Draw runs over each other, one subplot per metric, and table the settings that differ.

    In [1]: nbtrain.compare(["runs/a", "runs/b"], smooth=0.6, logy=True)

    `runs` are run folders (a finetune output_dir; a folder of run folders stands for all of them),
    registered run ids or names, or `RunData`. `metrics` are row keys; by default the Lab's overview
    of the runs' kind, tokens/s and the learning rate (`default_metrics`). `x` is "step" or "time"
    (seconds since each run's first row). `smooth` is TensorBoard's smoothing weight in [0, 1): the
    smoothed curve is drawn over a faint raw one (never for the learning rate, epoch, memory or MFU,
    nor a series on fewer than half the rows, such as eval loss). `logy` draws every y axis on a log
    scale (values <= 0 left out). Each run has its colour of the Lab (`nbtrain.plots.run_colour`).
    """
    if isinstance(metrics, str):
        metrics = [metrics]
    loaded = _expand(runs)
    if not loaded:
        msg = "nbtrain.compare needs run folders to compare, e.g. nbtrain.compare(['runs/a', 'runs/b'])"
        raise NotARunError(msg)
    if metrics is None:
        metrics = default_metrics(loaded)
    ema([], smooth)  # a bad weight fails here, before any drawing
    names = labels(loaded)
    notes = []
    if len(loaded) == 1:
        notes.append(f"one run ({names[0]}): pass two or more run folders to compare them")
    if x == "time":
        timeless = [n for n, r in zip(names, loaded, strict=True) if not has_time(r)]
        if timeless:
            msg = (
                f"x='time', but the rows of {', '.join(timeless)} carry no time (written before "
                "nbtrain logged one per row); use x='step' for these runs"
            )
            raise ValueError(msg)
    for name, run in zip(names, loaded, strict=True):
        if not run.config:
            notes.append(f"{name}: no sft_config.json, so its settings are not compared")
    drawn = [m for m in metrics if any(m in r.metrics for r in loaded)]
    if not drawn:
        have = sorted({m for r in loaded for m in r.metrics})
        msg = f"none of the runs logged {', '.join(metrics)}; they have: {', '.join(have) or 'no rows yet'}"
        raise ValueError(msg)
    curves = {
        m: [
            Curve(
                name,
                [p[0] for p in pts],
                [p[1] for p in pts],
                ema([p[1] for p in pts], smooth if smoothed(m, len(pts), len(run.rows)) else 0.0),
            )
            for name, run, pts in zip(names, loaded, series(loaded, m, x), strict=True)
        ]
        for m in drawn
    }
    diff, table = _tables(loaded, names)
    return Comparison(
        runs=loaded,
        labels=names,
        metrics=drawn,
        x=x,
        smooth=smooth,
        diff=diff,
        table=table,
        figure=_draw(curves, x, smooth, logy, loss_title(loaded), _colours(loaded)),
        curves=curves,
        notes=notes,
        samples=_samples(loaded, names),
    )


#: the loss axes' title where SFT runs (nats/token) are compared with others (no unit), as the Lab's
MIXED_LOSS_TITLE = "loss (nats/token for SFT runs)"


def loss_title(runs: Sequence[RunData]) -> str:
    """The loss axes' title, as the Lab's: "nats/token" where every run is SFT, "loss" where none
    is (a DPO or GRPO loss has no unit), MIXED_LOSS_TITLE where both are."""
    units = {unit("loss", r.kind) for r in runs}
    return units.pop() if len(units) == 1 else MIXED_LOSS_TITLE


def _colours(runs: Sequence[RunData]) -> list[str]:
    """Each run's colour in the Lab: its registry id's (the id the registry gives its folder)."""
    return [run_colour(r.run_id or run_id_for(r.path)) for r in runs]


def _draw(
    curves: dict[str, list[Curve]],
    x: str,
    smooth: float,
    logy: bool,
    loss: str = "nats/token",
    colours: Sequence[str] = (),
) -> Any:
    # two charts to a row, never wider than the output area, on a transparent background
    fig, axes = new_figure(len(curves))
    xs = [v for runs in curves.values() for c in runs for v in c.x]
    # one x range for the whole view, so the charts line up step for step
    xticks = nice_ticks(min(xs), max(xs), 6, integer=x == "step") if xs else []
    for ax, (metric, runs) in zip(axes, curves.items(), strict=True):
        scale = 100.0 if metric == "mfu" else 1.0
        for i, c in enumerate(runs):
            color = colours[i] if i < len(colours) else f"C{i % 10}"
            ys = [v * scale for v in c.smoothed]
            if c.smoothed != c.raw:
                raw = [v * scale for v in c.raw]
                ax.plot(c.x, raw, color=color, alpha=RAW_ALPHA, linewidth=1, zorder=1)
            ax.plot(c.x, ys, color=color, label=c.run, linewidth=1.6, zorder=2)
            if len(c.x) == 1:  # one point draws no line: mark it
                ax.plot(c.x, ys, "o", color=color)
        if logy:
            ax.set_yscale("log", nonpositive="mask")
        ylabel = loss if metric in ("loss", "eval_loss") else unit(metric)
        style_axes(ax, integer_x=x == "step", title=metric, ylabel=ylabel, xlabel=_x_title(x))
        if len(xticks) > 1:
            ax.set_xticks(xticks)
            ax.set_xlim(xticks[0], xticks[-1])
    legend(axes[0], loc="best")
    return fig


def _x_title(x: str) -> str:
    return "step" if x == "step" else "seconds"
