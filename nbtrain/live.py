"""The live training display under a running cell: loss and throughput curves, a progress bar, ETA, and
the completions sampled while training (a table under the curves, newest step first).

Fed with the payloads `nbtrain.log` publishes (see `nbtrain.engine.metrics`). It redraws at most once
a second on the client, so the engines never wait for it. When the run ends it leaves a static image
of the curves and a final metrics table in the cell output, which a saved notebook keeps.
"""

from __future__ import annotations

import base64
import html
import io
import time
from typing import Any

# metrics drawn as curves: (key, axis title)
PLOTS = (("loss", "loss"), ("tokens_per_s", "tokens/s"))
# a third curve where the rows have it: DPO's reward margin (nbtrain.recipes.dpo)
REWARD_PLOT = ("rewards/margins", "reward margin")
# or GRPO's mean reward (nbtrain.recipes.grpo.recipe)
GRPO_PLOT = ("reward", "reward")
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


# each curve's y axis title, with its unit, as the Lab run panel writes them; a run's `begin` may
# title its loss otherwise (DPO's and GRPO's losses are not nats/token: `nbtrain.runs.loss_unit`)
Y_TITLES = {"loss": "nats/token", "tokens_per_s": "tokens/s"}
# what the final output says of a run that ended so (the run's state, as its record and the Lab say
# it); "finished" for a run of `log` rows that no recipe ended with a state
ENDED = {"done": "finished", "stopped": "stopped", "preempted": "preempted", "failed": "failed"}


def _fmt(value: Any) -> str:
    """A metric in the final table: in full (six significant digits), so a learning rate of 1.5e-05
    reads 1.5e-05, not 0.0000."""
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _tick(value: float, _pos: Any = None) -> str:
    """An axis label as the Lab panel writes it: three significant digits, k and M from a thousand."""
    if value == 0:
        return "0"
    for div, suffix in ((1e6, "M"), (1e3, "k")):
        if abs(value) >= div:
            return f"{value / div:.3g}{suffix}"
    if abs(value) < 1e-2:
        return f"{value:.2g}"
    return f"{value:.3g}"


def _fmt_rate(value: float | None) -> str:
    if value is None:
        return "–"
    if value >= 1000:
        return f"{value / 1000:.1f}k"
    return f"{value:.0f}"


def _fmt_eta(seconds: float | None) -> str:
    if seconds is None or seconds != seconds:
        return "–"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class LiveDisplay:
    """One display area, updated in place: progress line, then the curves."""

    def __init__(self, min_interval: float = 1.0) -> None:
        self.min_interval = min_interval
        self.rows: list[dict[str, Any]] = []
        #: step -> the completions sampled at it (`SFTConfig.sample_prompts`)
        self.samples: dict[int, list[dict[str, Any]]] = {}
        self.total: int | None = None
        self.name: str | None = None
        #: the loss axis' title (the run's `loss_unit`) and how the run ended (its state)
        self.loss_unit: str | None = None
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
            self.loss_unit = payload.get("loss_unit")
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
        if last.get("loss") is not None:
            parts.append(f"loss {last['loss']:.4f}")
        if last.get("reward") is not None:  # GRPO's mean reward
            parts.append(f"reward {last['reward']:.3f}")
        if last.get("eval_loss") is not None:
            parts.append(f"eval {last['eval_loss']:.4f}")
        if last.get("tokens_per_s") is not None:
            parts.append(f"{_fmt_rate(last['tokens_per_s'])} tok/s")
        if not self.closed:
            parts.append(f"ETA {_fmt_eta(eta)}")
        return step, eta, " · ".join(parts)

    def _png(self) -> bytes | None:
        if not self.rows:
            return None
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import FuncFormatter, MaxNLocator

        plots = self._plots()
        if self._fig is None or len(self._axes) != len(plots):
            # 100 dpi and 9-11 pt text: the panel's sizes, readable where the notebook shows it
            self._fig = Figure(figsize=(4.4 * len(plots), 3.0), dpi=100)
            FigureCanvasAgg(self._fig)
            self._axes = self._fig.subplots(1, len(plots))
        fig, axes = self._fig, self._axes
        for ax, (key, title) in zip(axes, plots):
            ax.clear()
            pts = [
                (r["step"], r[key])
                for r in self.rows
                if r.get(key) is not None and r.get("step") is not None
            ]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=title, color="#1f77b4")
            if key == "loss":
                ev = [
                    (r["step"], r["eval_loss"])
                    for r in self.rows
                    if r.get("eval_loss") is not None and r.get("step") is not None
                ]
                if ev:
                    ax.plot(
                        [p[0] for p in ev],
                        [p[1] for p in ev],
                        "o-",
                        label="eval loss",
                        color="#ff7f0e",
                    )
                if pts or ev:
                    ax.legend(loc="upper right", fontsize=9, frameon=False)
            ax.set_title(title, fontsize=11, loc="left")
            ax.set_xlabel("step", fontsize=10)
            ax.set_ylabel(self._y_title(key, title), fontsize=10)
            ax.tick_params(labelsize=9, colors="#555555")
            ax.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))
            ax.yaxis.set_major_locator(MaxNLocator(nbins=5))
            ax.yaxis.set_major_formatter(FuncFormatter(_tick))
            ax.xaxis.set_major_formatter(FuncFormatter(_tick))
            for side in ("top", "right"):
                ax.spines[side].set_visible(False)
            ax.grid(alpha=0.25)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        return buf.getvalue()

    def _svg(self) -> str:
        """The live curves as inline SVG: a few KB of text that the browser draws.

        Drawing with matplotlib once a second cost the training ranks ~15% of their throughput on a
        2-core machine (the kernel competes with them for CPU); this costs well under a millisecond.
        """
        panels = []
        plots = self._plots()
        for i, (key, title) in enumerate(plots):
            series = [(key, "#1f77b4")]
            if key == "loss":
                series.append(("eval_loss", "#ff7f0e"))
            panels.append(_svg_panel(self.rows, series, title, x0=i * 330))
        return f"<svg xmlns='http://www.w3.org/2000/svg' width='{330 * len(plots)}' height='190' font-family='sans-serif' font-size='10'>{''.join(panels)}</svg>"

    def _y_title(self, key: str, title: str) -> str:
        if key == "loss" and self.loss_unit:
            return self.loss_unit
        return Y_TITLES.get(key, title)

    def _plots(self) -> tuple[tuple[str, str], ...]:
        """The curves to draw: PLOTS, and the reward margin (a DPO run) or the mean reward (GRPO)
        once a row has it."""
        if any(REWARD_PLOT[0] in r for r in self.rows):
            return (*PLOTS, REWARD_PLOT)
        if any(GRPO_PLOT[0] in r for r in self.rows):
            return (*PLOTS, GRPO_PLOT)
        return PLOTS

    def _table_html(self) -> str:
        if not self.rows:
            return ""
        last = self.rows[-1]
        keys = [k for k in TABLE_KEYS if k in last] + [k for k in last if k not in TABLE_KEYS]
        cells = "".join(
            f"<tr><th style='text-align:left'>{html.escape(k)}</th><td>{html.escape(_fmt(last[k]))}</td></tr>"
            for k in keys
        )
        return f"<table>{cells}</table>"

    def _table_text(self) -> str:
        if not self.rows:
            return ""
        last = self.rows[-1]
        return "\n".join(f"{k:>14}  {_fmt(v)}" for k, v in last.items())

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

        def cell(value: Any) -> str:
            text = "" if value is None else str(value)
            cut = text if len(text) <= SAMPLE_CHARS else text[:SAMPLE_CHARS] + "…"
            return (
                f"<td style='text-align:left;vertical-align:top;white-space:pre-wrap' "
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
                cell(r.get("completion") if r else None) for r in by_step.values()
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
            lines.append(f"  [{r.get('index')}] {r.get('prompt')!r} -> {r.get('completion')!r}")
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


def _svg_panel(
    rows: list[dict[str, Any]], series: list[tuple[str, str]], title: str, x0: int
) -> str:
    """One chart: `series` (key, colour) against step, with min/max labels on both axes."""
    w, h, left, top, bottom = 310, 150, 45, 18, 22
    pts = {
        key: [
            (r["step"], r[key])
            for r in rows
            if r.get(key) is not None and r.get("step") is not None
        ]
        for key, _ in series
    }
    every = [p for ps in pts.values() for p in ps]
    out = [
        f"<g transform='translate({x0},0)'><text x='{left + w / 2}' y='12' text-anchor='middle'>{html.escape(title)}</text>"
    ]
    out.append(
        f"<rect x='{left}' y='{top}' width='{w - left}' height='{h - bottom}' fill='none' stroke='#ccc'/>"
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
        out.append(f"<text x='{left - 3}' y='{top + 8}' text-anchor='end'>{_tick(ymax)}</text>")
        out.append(
            f"<text x='{left - 3}' y='{top + h - bottom}' text-anchor='end'>{_tick(ymin)}</text>"
        )
        out.append(f"<text x='{left}' y='{h + 10}'>{xmin}</text>")
        out.append(f"<text x='{w}' y='{h + 10}' text-anchor='end'>step {xmax}</text>")
    out.append("</g>")
    return "".join(out)
