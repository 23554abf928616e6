"""The notebook's plots in the Lab's look: palette and colour per run, ticks and number formats
(`style`, `numbers`), and which charts a run gets (`metrics`). No matplotlib until something draws;
nothing of nbtrain imported, so every kernel-side module can use it."""

from __future__ import annotations

from nbtrain.plots.metrics import Chart, charts, group, numeric_keys, overview, smoothed, unit
from nbtrain.plots.numbers import (
    EMPTY,
    MISSING,
    completion_text,
    format_cell,
    format_count,
    format_duration,
    format_time,
    format_value,
    tick_labels,
)
from nbtrain.plots.style import (
    INK,
    MAX_WIDTH_PX,
    PALETTE_DARK,
    PALETTE_LIGHT,
    RAW_ALPHA,
    fnv1a32,
    legend,
    new_figure,
    nice_ticks,
    png_bytes,
    run_colour,
    run_line_colours,
    series_colour,
    style_axes,
)

__all__ = [
    "EMPTY",
    "INK",
    "MAX_WIDTH_PX",
    "MISSING",
    "PALETTE_DARK",
    "PALETTE_LIGHT",
    "RAW_ALPHA",
    "Chart",
    "charts",
    "completion_text",
    "fnv1a32",
    "format_cell",
    "format_count",
    "format_duration",
    "format_time",
    "format_value",
    "group",
    "legend",
    "new_figure",
    "nice_ticks",
    "numeric_keys",
    "overview",
    "png_bytes",
    "run_colour",
    "run_line_colours",
    "series_colour",
    "smoothed",
    "style_axes",
    "tick_labels",
    "unit",
]
