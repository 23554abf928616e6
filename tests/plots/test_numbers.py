"""nbtrain.plots.numbers: the one number format, checked against the Lab's rules (charts-contract:
JS toPrecision(3) with k/M/G, e-notation under 0.01, one format per axis)."""

from __future__ import annotations

import datetime as dt
import math

import pytest

from nbtrain.plots import (
    format_cell,
    format_count,
    format_duration,
    format_time,
    format_value,
    tick_labels,
)


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (4.8547, "4.85"),  # the notebook wrote 4.8547 where the Lab wrote 4.85
        (0.1, "0.100"),
        (12, "12.0"),
        (2.5, "2.50"),
        (-0.5, "-0.500"),
        (3216.6, "3.22k"),
        (999.7, "1.00k"),  # rounding that reaches the next suffix takes it
        (999.4, "999"),
        (999_650, "1.00M"),
        (1.5e7, "15.0M"),
        (2.5e9, "2.50G"),
        (0.00195, "1.95e-3"),
        (0.0002, "2e-4"),
        (1.5e-5, "1.5e-5"),
        (0, "0"),
        (None, "–"),
        (math.nan, "–"),
        (math.inf, "–"),
    ],
)
def test_format_value_writes_what_the_lab_writes(value, text):
    assert format_value(value) == text


def test_counts_times_and_durations_are_not_floats():
    assert format_count(1.0) == "1" and format_count(12) == "12"
    assert format_count(None) == "–" and format_count(math.nan) == "–"
    t = 1_795_750_000.0  # the compare table wrote this as 1.79575e+09
    assert format_time(t) == dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")
    assert format_cell("time", t) == format_time(t) and "e+" not in format_cell("time", t)
    assert format_cell("step", 200.0) == "200" and format_cell("loss", 4.8547) == "4.85"
    assert format_duration(59.6) == "1:00" and format_duration(3725) == "1:02:05"
    assert format_duration(None) == "–"


@pytest.mark.parametrize(
    ("ticks", "labels"),
    [
        ([0, 0.5, 1, 1.5], ["0.0", "0.5", "1.0", "1.5"]),
        ([4.8, 4.85, 4.9], ["4.80", "4.85", "4.90"]),
        ([0, 5000, 10000], ["0", "5k", "10k"]),
        ([0, 2500, 5000], ["0", "2.5k", "5.0k"]),
        (
            [0.0019, 0.00195, 0.002],
            ["1.90e-3", "1.95e-3", "2.00e-3"],
        ),  # never 1.9e-3 beside 1.95e-3
        ([0, 200, 400], ["0", "200", "400"]),
        ([-1, 0, 1], ["-1", "0", "1"]),
    ],
)
def test_one_axis_has_one_format(ticks, labels):
    assert tick_labels(ticks) == labels
