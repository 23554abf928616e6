"""The look the notebook's plots share with the Lab's charts: the palette, one colour per run, tick
steps of 1, 2 or 5 x 10^n with the axis ending on a tick, one label format per axis, figures no
wider than a notebook's output area, and a transparent background that reads in both themes.

In [1]: from nbtrain.plots import run_colour, style_axes, new_figure
In [2]: fig, axes = new_figure(2)                 # two charts side by side, 880 px wide at most
In [3]: axes[0].plot(steps, loss, color=run_colour(run_id)); style_axes(axes[0])

Matplotlib is imported only by the functions that draw.
"""

from __future__ import annotations

import io
import logging
import math
from typing import Any

from nbtrain.plots.numbers import format_value, tick_labels

log = logging.getLogger(__name__)

#: the Lab's palette on a light background (every colour >= 4.6:1 on white), in order
PALETTE_LIGHT = (
    "#1f6fb4",
    "#c4501e",
    "#2a7f39",
    "#8e5bb8",
    "#8a6d00",
    "#c2407f",
    "#137a84",
    "#666666",
)
#: the same colours for a dark background (>= 7.5:1 on #111111); the notebook, whose theme the
#: kernel cannot know, draws with PALETTE_LIGHT on a transparent background
PALETTE_DARK = (
    "#5aa9f2",
    "#f2884f",
    "#5cc96e",
    "#c19bf0",
    "#e3c04a",
    "#f27fb3",
    "#4cc9d4",
    "#b0b0b0",
)
#: a raw (unsmoothed) line under its smoothed one: the run's colour at this alpha
RAW_ALPHA = 0.35
#: text, ticks and axis lines: a grey that reads on a white and on a dark notebook (3.9:1 on
#: white, 4.6:1 on #111111), since the image's background is transparent
INK = "#808080"
#: the widest figure, in pixels: JupyterLab's output area at 1400 px wide with the sidebar open,
#: so an image is never scaled down (a wider one was, to 7 px text)
MAX_WIDTH_PX = 880
#: pixels per inch of every figure: 9 pt text is 12.5 px on screen, as the Lab panel's
DPI = 100
CHART_HEIGHT_PX = 250
#: about this many ticks on a y axis (x: one more)
Y_TICKS = 5
_STEPS = [1, 2, 5, 10]


def fnv1a32(text: str) -> int:
    """FNV-1a, 32 bits, of `text`'s UTF-8 bytes: the hash the Lab picks a run's colour with."""
    h = 0x811C9DC5
    for b in text.encode():
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return h


def run_colour(run_id: str, palette: tuple[str, ...] = PALETTE_LIGHT) -> str:
    """The colour of a run in every view, Lab and notebook: its registry id's hash picks it, so a
    run keeps its colour whatever runs are shown beside it (`nbtrain.runs.run_id_for`)."""
    return palette[fnv1a32(run_id) % len(palette)]


def series_colour(i: int, palette: tuple[str, ...] = PALETTE_LIGHT) -> str:
    """The colour of the i-th series of one run's chart (loss, then eval loss): the palette in order."""
    return palette[i % len(palette)]


def run_line_colours(
    run_id: str | None, n: int, palette: tuple[str, ...] = PALETTE_LIGHT
) -> list[str]:
    """The colours of one run's `n` lines in a chart of its own, as the Lab's run panel draws them
    (metrics.ts `runLineColours`): the run's colour for the first (the loss), then the palette's
    next ones, so no colour repeats in a chart of up to 8 lines. Rows with no run (your own
    `nbtrain.log`) take the palette in order."""
    first = 0 if run_id is None else fnv1a32(run_id) % len(palette)
    return [palette[(first + i) % len(palette)] for i in range(n)]


def nice_ticks(lo: float, hi: float, n: int = Y_TICKS, integer: bool = False) -> list[float]:
    """Ticks of step 1, 2 or 5 x 10^n covering [lo, hi]: the first at or below lo, the last at or
    above hi, about `n` of them (whole numbers only when `integer`)."""
    from matplotlib.ticker import MaxNLocator

    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi == lo:
        pad = abs(lo) * 0.05 or 1.0
        lo, hi = lo - pad, hi + pad
    ticks = [
        float(t) for t in MaxNLocator(nbins=n, steps=_STEPS, integer=integer).tick_values(lo, hi)
    ]
    step = ticks[1] - ticks[0] if len(ticks) > 1 else 1.0
    below = [t for t in ticks if t <= lo + step * 1e-9]
    above = [t for t in ticks if t >= hi - step * 1e-9]
    first, last = (below[-1] if below else ticks[0]), (above[0] if above else ticks[-1])
    # clean the float noise of the locator (0.30000000000000004): a tick is a multiple of its step
    digits = max(0, -math.floor(math.log10(step)) + 2) if step > 0 else 6
    return [round(t, digits) for t in ticks if first <= t <= last]


def _data_range(ax: Any, axis: str) -> tuple[float, float] | None:
    values: list[float] = []
    for line in ax.get_lines():
        data = line.get_ydata() if axis == "y" else line.get_xdata()
        values.extend(float(v) for v in data if v is not None and math.isfinite(float(v)))
    if ax.get_yscale() == "log" and axis == "y":
        values = [v for v in values if v > 0]
    return (min(values), max(values)) if values else None


class AxisFormatter:
    """A matplotlib tick formatter writing every tick of an axis in one format (`tick_labels`);
    a single value (the cursor's read-out) is written as `format_value` writes it."""

    def __new__(cls) -> Any:
        from matplotlib.ticker import Formatter

        class _Formatter(Formatter):  # type: ignore[misc]
            def format_ticks(self, values: Any) -> list[str]:
                return tick_labels(list(values))

            def __call__(self, x: float, pos: Any = None) -> str:
                return format_value(x)

            def format_data_short(self, value: float) -> str:
                return format_value(value)

        return _Formatter()


def style_axes(
    ax: Any,
    *,
    integer_x: bool = True,
    title: str | None = None,
    ylabel: str | None = None,
    xlabel: str | None = None,
) -> None:
    """Call after the lines are drawn: ticks of 1/2/5 x 10^n with the axes ending on a tick (no data
    above the last label), one label format per axis, the shared text sizes and grey ink, no top or
    right frame. `integer_x`: the x axis counts steps (never a fractional tick). A log y axis gets
    ticks at 1, 2 and 5 x 10^n."""
    from matplotlib.ticker import FixedLocator, LogLocator

    if title is not None:
        ax.set_title(title, fontsize=10, loc="left", color=INK)
    if ylabel is not None:
        ax.set_ylabel(ylabel, fontsize=9, color=INK)
    if xlabel is not None:
        ax.set_xlabel(xlabel, fontsize=9, color=INK)
    for axis, n, integer in (("x", Y_TICKS + 1, integer_x), ("y", Y_TICKS, False)):
        which = ax.xaxis if axis == "x" else ax.yaxis
        log = (ax.get_yscale() if axis == "y" else ax.get_xscale()) == "log"
        span = _data_range(ax, axis)
        if log:
            which.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        elif span is not None:
            ticks = nice_ticks(span[0], span[1], n, integer=integer)
            if ticks:
                which.set_major_locator(FixedLocator(ticks))
                (ax.set_xlim if axis == "x" else ax.set_ylim)(ticks[0], ticks[-1])
        which.set_major_formatter(AxisFormatter())
    ax.tick_params(labelsize=9, colors=INK)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    for side in ("left", "bottom"):
        ax.spines[side].set_color(INK)
    ax.grid(True, alpha=0.25, color=INK, linewidth=0.6)


def new_figure(
    charts: int, per_row: int = 2, height_px: int = CHART_HEIGHT_PX
) -> tuple[Any, list[Any]]:
    """A plain matplotlib Figure (not pyplot, so the inline backend does not show it twice) for
    `charts` charts, `per_row` to a row, at most MAX_WIDTH_PX wide; and its axes, in reading order
    (the unused ones of the last row hidden)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    charts = max(1, charts)
    cols = min(per_row, charts)
    rows = math.ceil(charts / cols)
    width = MAX_WIDTH_PX if cols > 1 else MAX_WIDTH_PX * 0.6
    fig = Figure(figsize=(width / DPI, rows * height_px / DPI), dpi=DPI, layout="constrained")
    fig.patch.set_alpha(0.0)
    FigureCanvasAgg(fig)
    axes = list(fig.subplots(rows, cols, squeeze=False).ravel())
    for ax in axes:
        ax.patch.set_alpha(0.0)
    for ax in axes[charts:]:
        ax.set_visible(False)
    return fig, axes[:charts]


def png_bytes(fig: Any) -> bytes:
    """The figure as PNG on a transparent background, at its own size (never wider than the figure)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", transparent=True, dpi=DPI)
    return buf.getvalue()


def legend(ax: Any, **kwargs: Any) -> Any:
    """A legend in the shared style (small, no frame, grey text), where it covers least."""
    leg = ax.legend(fontsize=8, frameon=False, labelcolor=INK, **kwargs)
    return leg


__all__ = [
    "CHART_HEIGHT_PX",
    "DPI",
    "INK",
    "MAX_WIDTH_PX",
    "PALETTE_DARK",
    "PALETTE_LIGHT",
    "RAW_ALPHA",
    "AxisFormatter",
    "fnv1a32",
    "legend",
    "new_figure",
    "nice_ticks",
    "png_bytes",
    "run_colour",
    "run_line_colours",
    "series_colour",
    "style_axes",
]
