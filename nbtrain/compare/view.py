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
import io
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
from nbtrain.runs import loss_unit

#: the last values a comparison's table shows, where any run has them
FINAL_COLUMNS = ("step", "loss", "eval_loss", "grad_norm", "tokens_per_s", "mfu", "peak_memory_gb")
_TITLES = {"tokens_per_s": "tokens/s", "learning_rate": "learning rate", "eval_loss": "eval loss"}
#: each metric's y axis title, with its unit (the Lab's charts say the same)
Y_TITLES = {
    "loss": "nats/token",
    "eval_loss": "nats/token",
    "tokens_per_s": "tokens/s",
    "learning_rate": "learning rate",
    "grad_norm": "L2 norm",
    "mfu": "MFU",
    "peak_memory_gb": "GB",
}
# a faint raw curve under the smoothed one, as TensorBoard draws it
_RAW_ALPHA = 0.25


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
        """The figure as PNG bytes."""
        buf = io.BytesIO()
        self.figure.savefig(buf, format="png", bbox_inches="tight")
        return buf.getvalue()

    def csv(self) -> str:
        """Every run's curves as CSV: columns run, x, then each metric."""
        return series_csv(self.runs, self.metrics, self.x)

    def markdown(self) -> str:
        """The table as Markdown, one column per run."""
        t = self.table.T
        head = ["", *map(str, t.columns)]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for name, row in t.iterrows():
            cells = [str(name), *(_fmt(v) for v in row)]
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
            tmp = out / f".{name}.{os.getpid()}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, out / name)
            written[name.rsplit(".", 1)[1]] = str(out / name)
        return written

    def _repr_html_(self) -> str:
        img = base64.b64encode(self.png()).decode()
        notes = "".join(f"<p><i>{html.escape(n)}</i></p>" for n in self.notes)
        table = self.table.T.to_html(escape=True, na_rep="–", float_format=_fmt)
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
    """A samples table cell: the text, or a dash where the run did not sample that prompt."""
    return value if isinstance(value, str) else "–"


def _fmt(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float):
        return (
            f"{value:.3e}"
            if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5)
            else f"{value:.4g}"
        )
    return str(value)


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


def compare(
    runs: Any,
    metrics: Sequence[str] = COMPARE_METRICS,
    x: str = "step",
    smooth: float = 0.0,
    logy: bool = False,
) -> Comparison:
    """Draw runs over each other, one subplot per metric, and table the settings that differ.

    In [1]: nbtrain.compare(["runs/a", "runs/b"], smooth=0.6, logy=True)

    `runs` are run folders (a finetune output_dir; a folder of run folders stands for all of them),
    registered run ids or names, or `RunData`. `x` is "step" or "time" (seconds since each run's first
    row). `smooth` is TensorBoard's smoothing weight in [0, 1): the smoothed curve is drawn over a faint
    raw one. `logy` draws every y axis on a log scale (values <= 0 left out).
    """
    if isinstance(metrics, str):
        metrics = [metrics]
    loaded = _expand(runs)
    if not loaded:
        msg = "nbtrain.compare needs run folders to compare, e.g. nbtrain.compare(['runs/a', 'runs/b'])"
        raise NotARunError(msg)
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
            Curve(name, [p[0] for p in pts], [p[1] for p in pts], ema([p[1] for p in pts], smooth))
            for name, pts in zip(names, series(loaded, m, x), strict=True)
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
        figure=_draw(curves, x, smooth, logy, loss_title(loaded)),
        curves=curves,
        notes=notes,
        samples=_samples(loaded, names),
    )


def loss_title(runs: Sequence[RunData]) -> str:
    """The loss axes' title: the unit of the runs' kind (`nbtrain.runs.loss_unit`), or "loss" where
    runs of different kinds (SFT's nats/token beside DPO's loss per pair) share the axes."""
    kinds = {r.kind for r in runs}
    return loss_unit(kinds.pop()) if len(kinds) == 1 else "loss (each run's own unit)"


def _draw(
    curves: dict[str, list[Curve]], x: str, smooth: float, logy: bool, loss: str = "nats/token"
) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    n = len(curves)
    ncols = min(2, n)
    nrows = math.ceil(n / ncols)
    # a plain Figure, not pyplot: the inline backend would show it a second time
    fig = Figure(figsize=(6.0 * ncols, 3.4 * nrows), dpi=80, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, (metric, runs) in zip(axes, curves.items(), strict=False):
        for i, c in enumerate(runs):
            color = f"C{i % 10}"
            if smooth > 0:
                ax.plot(c.x, c.raw, color=color, alpha=_RAW_ALPHA, linewidth=1, zorder=1)
                ax.plot(c.x, c.smoothed, color=color, label=c.run, linewidth=1.6, zorder=2)
            else:
                ax.plot(c.x, c.raw, color=color, label=c.run, linewidth=1.6)
            if len(c.x) == 1:  # one point draws no line: mark it
                ax.plot(c.x, c.smoothed, "o", color=color)
        ax.set_title(_TITLES.get(metric, metric))
        ax.set_xlabel("step" if x == "step" else "seconds")
        ax.set_ylabel(loss if metric in ("loss", "eval_loss") else Y_TITLES.get(metric, metric))
        if x == "step":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if logy:
            ax.set_yscale("log", nonpositive="mask")
        ax.grid(True, alpha=0.3)
    for ax in axes[n:]:
        ax.set_visible(False)
    axes[0].legend(fontsize="small")
    return fig
