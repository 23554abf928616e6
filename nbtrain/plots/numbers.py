"""One way to write a number, the Lab's (`labextension/src`, formatValue): values in tables,
legends and progress lines, the labels of an axis' ticks, counts, wall-clock times and durations.

In [1]: from nbtrain.plots import format_value, tick_labels
In [2]: format_value(4.8547), format_value(3216.6), format_value(0.00195)
Out[2]: ('4.85', '3.22k', '1.95e-3')
In [3]: tick_labels([4.8, 4.85, 4.9])
Out[3]: ['4.80', '4.85', '4.90']
"""

from __future__ import annotations

import datetime as _dt
import logging
import math
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)

#: what a completion of nothing but blanks is written as (the Lab's words)
EMPTY = "(empty)"
#: what a missing value is written as (None, NaN, infinities; a count that is not there)
MISSING = "–"
# k, M, G from a thousand on: (divisor, suffix), largest first
_SUFFIXES = ((1e9, "G"), (1e6, "M"), (1e3, "k"))
#: row keys that count things: written as integers, never 1.0
COUNT_KEYS = ("step", "nodes", "ranks", "world_size", "tokens", "index")
#: row keys that are wall-clock times (seconds since the epoch): written as a date and time
TIME_KEYS = ("time", "started", "ended")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    v = float(value)
    return v if math.isfinite(v) else None


def _exp(v: float, decimals: int, strip: bool) -> str:
    mantissa, exponent = f"{v:.{decimals}e}".split("e")
    if strip and "." in mantissa:
        mantissa = mantissa.rstrip("0").rstrip(".")
    return f"{mantissa}e{int(exponent)}"


def format_value(value: Any) -> str:
    """A value as the Lab writes it: 3 significant digits (4.8547 -> "4.85", 12 -> "12.0"), k/M/G
    from a thousand (3216.6 -> "3.22k"), e-notation below 0.01 (0.00195 -> "1.95e-3"), "–" for a
    missing value. Not for counts (`format_count`) or wall-clock times (`format_time`)."""
    v = _number(value)
    if v is None:
        return str(value) if isinstance(value, str) else MISSING
    if v == 0:
        return "0"
    a = abs(v)
    if float(f"{a:.3g}") >= 1e3:
        # rounding that reaches the next suffix uses it: 999.7 -> 1.00k, 999_650 -> 1.00M
        for div, suffix in _SUFFIXES:
            if a >= div or float(f"{a:.3g}") >= div:
                return _sig3(v / div) + suffix
        return _sig3(v)  # pragma: no cover (a >= 1e3 always finds "k")
    if a < 1e-2 and float(f"{a:.3g}") < 1e-2:
        return _exp(v, 2, strip=True)
    return _sig3(v)


def _sig3(v: float) -> str:
    text = f"{v:#.3g}"
    if "e" in text:  # 3 significant digits of 1000 or more: the suffixes have taken those
        return f"{v:.0f}"
    return text.rstrip(".")


def format_count(value: Any) -> str:
    """A count (step, nodes, ranks): an integer, "–" when missing; 1.0 is "1"."""
    v = _number(value)
    if v is None:
        return MISSING
    return str(int(round(v))) if v == round(v) else format_value(v)


def format_time(value: Any) -> str:
    """A wall-clock time (seconds since the epoch) as this machine's local date and time."""
    v = _number(value)
    if v is None:
        return MISSING
    return _dt.datetime.fromtimestamp(v).strftime("%Y-%m-%d %H:%M:%S")


def format_duration(seconds: Any) -> str:
    """Seconds as h:mm:ss (m:ss under an hour); "–" when missing."""
    v = _number(seconds)
    if v is None or v < 0:
        return MISSING
    s = int(round(v))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def format_cell(key: str, value: Any) -> str:
    """A metric row's value in a table, by what its key is: a count, a time, or a value."""
    if key in COUNT_KEYS:
        return format_count(value)
    if key in TIME_KEYS:
        return format_time(value)
    return format_value(value)


def completion_text(text: str) -> str:
    """A sampled completion as shown: without the U+FFFD replacement characters at its end (a
    sample cut at its token limit inside a multi-byte character decodes to them, and the character
    is not there to show), and "(empty)" where the model wrote only blanks, as the Lab writes it."""
    text = text.rstrip("\ufffd")
    return text if text.strip() else EMPTY


def _decimals(values: Sequence[float], scale: float = 1.0, most: int = 8) -> int:
    """The fewest decimals that write every value / scale exactly (to a millionth of their step)."""
    scaled = [v / scale for v in values]
    diffs = [abs(b - a) for a, b in zip(scaled, scaled[1:], strict=False) if b != a]
    tol = (min(diffs) if diffs else max(map(abs, scaled), default=1.0) or 1.0) * 1e-6
    for d in range(most + 1):
        if all(abs(round(v, d) - v) <= tol for v in scaled):
            return d
    return most


def tick_labels(ticks: Sequence[float]) -> list[str]:
    """The labels of one axis' ticks in one format: the same decimals on every tick, the fewest that
    write each exactly (0.0 0.5 1.0; 4.80 4.85 4.90), a shared k/M/G (0 5k 10k), and e-notation with
    the same mantissa decimals where every tick is below 0.01 (1.90e-3 1.95e-3 2.00e-3)."""
    vals = [float(t) for t in ticks]
    if not vals:
        return []
    top = max(abs(v) for v in vals)
    if top == 0:
        return ["0" for _ in vals]
    if top < 1e-2:
        # the mantissa decimals: the fewest that write every tick exactly at the largest exponent
        exp = math.floor(math.log10(top))
        d = _decimals(vals, 10.0**exp)
        d = max(d, _decimals([v / 10.0 ** math.floor(math.log10(abs(v))) for v in vals if v]))
        return ["0" if v == 0 else _exp(v, d, strip=False) for v in vals]
    for div, suffix in _SUFFIXES:
        if top >= div:
            d = _decimals(vals, div)
            return ["0" if v == 0 else f"{v / div:.{d}f}{suffix}" for v in vals]
    d = _decimals(vals)
    return [f"{v:.{d}f}" for v in vals]


__all__ = [
    "COUNT_KEYS",
    "EMPTY",
    "MISSING",
    "TIME_KEYS",
    "completion_text",
    "format_cell",
    "format_count",
    "format_duration",
    "format_time",
    "format_value",
    "tick_labels",
]
