"""The live training display under a running cell: loss and throughput curves, a progress bar, ETA, and
the completions sampled while training (a table under the curves, newest step first).

Fed with the payloads `nbtrain.log` publishes (see `nbtrain.engine.metrics`). It redraws at most once
a second on the client, so the engines never wait for it. When the run ends it leaves a static image
of the curves and a final metrics table in the cell output, which a saved notebook keeps.
"""

from __future__ import annotations

import base64
import html
import logging
import time
from typing import Any

from nbtrain.plots import (
    EMPTY,
    Chart,
    completion_text,
    format_cell,
    format_duration,
    format_value,
    numeric_keys,
    overview,
    run_line_colours,
    unit,
)

log = logging.getLogger(__name__)

# the charts of the live display: the Lab's overview of the run's kind (`nbtrain.plots.overview`:
# SFT's loss, DPO's loss, reward margin and accuracy, GRPO's rewards, completion length, KL and
# loss), then throughput; at most this many, two to a row
LIVE_CHARTS = 6
THROUGHPUT = Chart("tokens_per_s", ("tokens_per_s",))
TABLE_KEYS = (
    "step",
    "epoch",
    "loss",
    "eval_loss",
    "grad_norm",
    "learning_rate",
    "tokens_per_s",
    "step_time",
    "mfu",
    "peak_mem_gb",
)
# the samples table: this many of the newest sampled steps, each completion cut to this many characters
SAMPLE_STEPS_SHOWN = 4
SAMPLE_CHARS = 240
# and the first this many prompts (the rest are in samples.jsonl)
SAMPLE_PROMPTS_SHOWN = 16


# what the final output says of a run that ended so (the run's state, as its record and the Lab say
# it); "finished" for a run of `log` rows that no recipe ended with a state
ENDED = {"done": "finished", "stopped": "stopped", "preempted": "preempted", "failed": "failed"}


def _fmt(key: str, value: Any) -> str:
    """A metric in the final table, as the Lab writes it (`nbtrain.plots.format_cell`): 4.85, 3.22k,
    1.5e-5; a step as an integer and the wall-clock time as a date, never 1.79575e+09."""
    if value is None:
        return "–"
    return format_cell(key, value)


class LiveDisplay:
    """One display area, updated in place: progress line, then the curves."""

    def __init__(self, min_interval: float = 1.0) -> None:
        self.min_interval = min_interval
        self.rows: list[dict[str, Any]] = []
        #: step -> the completions sampled at it (`SFTConfig.sample_prompts`)
        self.samples: dict[int, list[dict[str, Any]]] = {}
        self.total: int | None = None
        self.name: str | None = None
        #: what the run trains (sft, dpo, grpo; None for rows of your own `nbtrain.log`), and how
        #: it ended (its state)
        self.run_kind: str | None = None
        #: the loss axis' title a caller gave without a kind (the Tinker service's "summed loss")
        self.loss_unit: str | None = None
        #: the run's registry id: its loss is drawn in the run's colour, as in the Lab
        self.run_id: str | None = None
        self.ended: str | None = None
        self.t0 = time.monotonic()
        self.closed = False
        self._handle: Any = None
        self._last_render = 0.0
        self._dirty = False
        self._fig: Any = None
        self._axes: Any = None

    # --- input ----------------------------------------------------------------------------------
    def feed(self, payload: dict[str, Any]) -> None:
        kind = payload.get("kind")
        if kind == "begin":
            self.total = payload.get("total_steps")
            self.name = payload.get("name")
            self.run_kind = payload.get("run_kind")
            self.loss_unit = payload.get("loss_unit")
            self.run_id = payload.get("run_id")
            self.ended = None
            self.t0 = time.monotonic()
            self.rows = []
            self.samples = {}
            self._dirty = True
        elif kind == "samples":
            self.samples[int(payload.get("step", 0))] = list(payload.get("rows", []))
            self._dirty = True
        elif kind == "row":
            self.rows.append(dict(payload.get("row", {})))
            self._dirty = True
        elif kind == "end":
            self.ended = payload.get("state") or self.ended
            self.close()
            return
        self.maybe_render()

    def maybe_render(self) -> None:
        if self.closed or not self._dirty:
            return
        now = time.monotonic()
        if now - self._last_render >= self.min_interval or self._handle is None:
            self.render()

    def close(self) -> None:
        """Draw the final state: the curves as a static image and the last metrics as a table."""
        if self.closed:
            return
        self.closed = True
        self.render(final=True)

    # --- output ---------------------------------------------------------------------------------
    def _progress(self) -> tuple[int | None, float | None, str]:
        step = self.rows[-1].get("step") if self.rows else None
        eta = None
        if step and self.total:
            elapsed = time.monotonic() - self.t0
            eta = elapsed / step * max(0, self.total - step)
        last = self.rows[-1] if self.rows else {}
        parts = []
        if step is not None:
            parts.append(f"step {step}/{self.total}" if self.total else f"step {step}")
        for key, label in (("loss", "loss"), ("reward", "reward"), ("eval_loss", "eval")):
            if last.get(key) is not None:  # GRPO's mean reward: not only a loss near 0
                parts.append(f"{label} {format_value(last[key])}")
        if last.get("tokens_per_s") is not None:
            parts.append(f"{format_value(last['tokens_per_s'])} tok/s")
        if not self.closed:
            parts.append(f"ETA {format_duration(eta)}")
        return step, eta, " · ".join(parts)

    def _png(self) -> bytes | None:
        if not self.rows:
            return None
        from nbtrain.plots import legend, new_figure, png_bytes, style_axes

        plots = self._plots()
        if self._fig is None or len(self._axes) != len(plots):
            # two charts to a row, never wider than the output area (three in a row were 1320 px,
            # shown scaled down to 7 px text), on a transparent background for either theme
            self._fig, self._axes = new_figure(len(plots))
        for ax, chart in zip(self._axes, plots, strict=True):
            ax.clear()
            ax.patch.set_alpha(0.0)
            colours = run_line_colours(self.run_id, len(chart.keys))
            for key, colour in zip(chart.keys, colours, strict=True):
                pts = _points(self.rows, key)
                if pts:
                    # eval loss is sparse: its points marked
                    style = "o-" if key.startswith("eval_") else "-"
                    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
                    ax.plot(xs, ys, style, color=colour, label=key, lw=1.5, ms=3)
            style_axes(ax, title=chart.title, ylabel=self._y_title(chart.keys[0]), xlabel="step")
            if len(chart.keys) > 1 and ax.get_lines():
                legend(ax, loc="upper right")
        return png_bytes(self._fig)

    def _svg(self) -> str:
        """The live curves as inline SVG: a few KB of text that the browser draws.

        Drawing with matplotlib once a second cost the training ranks ~15% of their throughput on a
        2-core machine (the kernel competes with them for CPU); this costs well under a millisecond.
        """
        plots = self._plots()
        panels = [
            _svg_panel(
                self.rows,
                list(zip(chart.keys, run_line_colours(self.run_id, len(chart.keys)), strict=True)),
                chart.title,
                x0=(i % 2) * SVG_W,
                y0=(i // 2) * SVG_H,
            )
            for i, chart in enumerate(plots)
        ]
        width = SVG_W * min(2, len(plots))
        height = SVG_H * ((len(plots) + 1) // 2)
        return f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' font-family='sans-serif' font-size='11' fill='{_INK}'>{''.join(panels)}</svg>"

    def _y_title(self, key: str) -> str:
        """The axis title of `key`: its unit where it has one (an SFT loss's nats/token; a DPO or
        GRPO loss has none), as the Lab titles it."""
        if key in ("loss", "eval_loss") and self.run_kind is None and self.loss_unit:
            return self.loss_unit
        return unit(key, self.run_kind)

    def _plots(self) -> list[Chart]:
        """The charts to draw: the overview of the run's kind as the Lab draws it (its loss first),
        then throughput, as the rows have them."""
        keys = numeric_keys(self.rows)
        kind = self.run_kind
        if kind is None:  # rows of your own nbtrain.log: told by what they hold
            kind = "dpo" if "rewards/margins" in keys else "grpo" if "reward" in keys else "sft"
        charts = overview(kind, keys)
        if "tokens_per_s" in keys:
            charts.append(THROUGHPUT)
        return charts[:LIVE_CHARTS]

    def _table_html(self) -> str:
        if not self.rows:
            return ""
        last = self.rows[-1]
        keys = [k for k in TABLE_KEYS if k in last] + [k for k in last if k not in TABLE_KEYS]
        cells = "".join(
            f"<tr><th style='text-align:left'>{html.escape(k)}</th><td>{html.escape(_fmt(k, last[k]))}</td></tr>"
            for k in keys
        )
        return f"<table>{cells}</table>"

    def _table_text(self) -> str:
        if not self.rows:
            return ""
        last = self.rows[-1]
        return "\n".join(f"{k:>14}  {_fmt(k, v)}" for k, v in last.items())

    def _samples_html(self) -> str:
        """Each prompt's completion by step, the newest step first (the newest SAMPLE_STEPS_SHOWN)."""
        if not self.samples:
            return ""
        steps = sorted(self.samples, reverse=True)[:SAMPLE_STEPS_SHOWN]
        prompts: dict[int, dict[str, Any]] = {}
        for step in sorted(self.samples):
            for r in self.samples[step]:
                prompts[r.get("index", 0)] = r
        has_ref = any(r.get("reference") is not None for r in prompts.values())

        def cell(value: Any, completion: bool = False) -> str:
            text = "" if value is None else str(value)
            style = "text-align:left;vertical-align:top;white-space:pre-wrap"
            if completion and value is not None:
                text = completion_text(text)
                if text == EMPTY:  # the model wrote nothing: say so, as the Lab does
                    return f"<td style='{style};opacity:.6;font-style:italic'>{EMPTY}</td>"
            cut = text if len(text) <= SAMPLE_CHARS else text[:SAMPLE_CHARS] + "…"
            return (
                f"<td style='{style}' "
                f"title='{html.escape(text, quote=True)}'>{html.escape(cut)}</td>"
            )

        head = "<th style='text-align:left'>prompt</th>" + "".join(
            f"<th style='text-align:left'>step {s}</th>" for s in steps
        )
        if has_ref:
            head += "<th style='text-align:left'>reference</th>"
        body = []
        for index in sorted(prompts)[:SAMPLE_PROMPTS_SHOWN]:
            by_step = {
                s: next((r for r in self.samples[s] if r.get("index", 0) == index), None)
                for s in steps
            }
            cells = cell(prompts[index].get("prompt")) + "".join(
                cell(r.get("completion") if r else None, completion=True) for r in by_step.values()
            )
            if has_ref:
                cells += cell(prompts[index].get("reference"))
            body.append(f"<tr>{cells}</tr>")
        more = len(prompts) - SAMPLE_PROMPTS_SHOWN
        note = f"<br><i>{more} more prompt(s) in samples.jsonl</i>" if more > 0 else ""
        return (
            "<details open><summary>samples</summary>"
            f"<table class='nbtrain-samples'><tr>{head}</tr>{''.join(body)}</table>{note}</details>"
        )

    def _samples_text(self) -> str:
        step = max(self.samples)
        lines = [f"samples at step {step}:"]
        for r in self.samples[step]:
            text = completion_text(str(r.get("completion") or ""))
            shown = text if text == EMPTY else repr(text)
            lines.append(f"  [{r.get('index')}] {r.get('prompt')!r} -> {shown}")
        return "\n".join(lines)

    def bundle(self, final: bool = False) -> dict[str, Any]:
        step, _, line = self._progress()
        # live frames are SVG drawn by the browser; the final, static image is one matplotlib PNG
        png = self._png() if final else None
        title = html.escape(self.name or "training")
        bar = ""
        if self.total and step is not None and not final:
            bar = f"<progress value='{step}' max='{self.total}' style='width:40%'></progress> "
        img = ""
        if png is not None:
            img = f"<br><img src='data:image/png;base64,{base64.b64encode(png).decode()}'/>"
        elif self.rows:
            img = "<br>" + self._svg()
        table = self._table_html() if final else ""
        state = ENDED.get(self.ended or "done", self.ended or "finished") if final else "running"
        samples = self._samples_html()
        doc = f"<div class='nbtrain-live'><b>{title}</b> ({state}) {bar}<code>{html.escape(line)}</code>{img}{table}{samples}</div>"
        text = f"{self.name or 'training'} ({state}): {line}"
        if final:
            text += "\n" + self._table_text()
        if final and self.samples:
            text += "\n" + self._samples_text()
        data: dict[str, Any] = {"text/plain": text, "text/html": doc}
        if png is not None and final:
            data["image/png"] = base64.b64encode(png).decode()
        return data

    def render(self, final: bool = False) -> None:
        from IPython.display import display

        data = self.bundle(final=final)
        if final:
            # the static image is the HTML's inline PNG; offer the raw PNG only as a fallback
            data.pop("image/png", None)
        if self._handle is None:
            self._handle = display(data, raw=True, display_id=True)
        else:
            self._handle.update(data, raw=True)
        self._last_render = time.monotonic()
        self._dirty = False


def _points(rows: list[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    """(step, value) of the rows that have a number for `key`; MFU as a percentage, as titled."""
    scale = 100.0 if key == "mfu" else 1.0
    return [
        (r["step"], float(r[key]) * scale)
        for r in rows
        if isinstance(r.get(key), int | float)
        and not isinstance(r.get(key), bool)
        and r.get("step") is not None
    ]


# one live SVG chart's box; two to a row, 860 px wide in all, inside the output area
SVG_W, SVG_H = 430, 200
_INK = "#808080"


def _svg_panel(
    rows: list[dict[str, Any]], series: list[tuple[str, str]], title: str, x0: int, y0: int = 0
) -> str:
    """One chart: `series` (key, colour) against step, with min/max labels on both axes."""
    w, h, left, top, bottom = SVG_W - 20, SVG_H - 40, 50, 18, 22
    pts = {key: _points(rows, key) for key, _ in series}
    every = [p for ps in pts.values() for p in ps]
    out = [
        f"<g transform='translate({x0},{y0})'><text x='{left}' y='12'>{html.escape(title)}</text>"
    ]
    out.append(
        f"<rect x='{left}' y='{top}' width='{w - left}' height='{h - bottom}' fill='none' stroke='{_INK}' stroke-opacity='0.4'/>"
    )
    if every:
        xs = [p[0] for p in every]
        ys = [float(p[1]) for p in every]
        xmin, xmax = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
        # throughput from zero, so step-to-step noise does not look like a collapse
        ymin = 0.0 if series[0][0] == "tokens_per_s" else min(ys)
        ymax = max(ys) if max(ys) > ymin else ymin + 1

        def sx(x: float) -> float:
            return left + (x - xmin) / (xmax - xmin) * (w - left)

        def sy(y: float) -> float:
            return top + (1 - (y - ymin) / (ymax - ymin)) * (h - bottom)

        for key, colour in series:
            if pts[key]:
                path = " ".join(f"{sx(x):.1f},{sy(float(y)):.1f}" for x, y in pts[key])
                out.append(
                    f"<polyline points='{path}' fill='none' stroke='{colour}' stroke-width='1.5'/>"
                )
        out.append(
            f"<text x='{left - 3}' y='{top + 8}' text-anchor='end'>{format_value(ymax)}</text>"
        )
        out.append(
            f"<text x='{left - 3}' y='{top + h - bottom}' text-anchor='end'>{format_value(ymin)}</text>"
        )
        out.append(f"<text x='{left}' y='{h + 12}'>{xmin}</text>")
        out.append(f"<text x='{w}' y='{h + 12}' text-anchor='end'>step {xmax}</text>")
    out.append("</g>")
    return "".join(out)
