"""Compare training runs: `nbtrain.compare([...])` draws them, the functions here give their data.

In [1]: nbtrain.compare(["runs/lr-1e-3", "runs/lr-1e-2"], smooth=0.6)

`nbtrain.compare` is this module, made callable: the data API (`load_run`, `config_diff`, `series`,
`ema`, `series_csv`, `load_samples`, `side_by_side`) lives in `nbtrain.compare.data` and is imported from here, while calling the module
draws the comparison (`nbtrain.compare.view.compare`; matplotlib loads only when it draws). Both have to answer to the same name, and
importing a submodule rebinds the package's attribute to the module, so the module itself is the callable.
"""

from __future__ import annotations

import logging
import sys
import types
from typing import Any

from nbtrain.compare.data import (
    COMPARE_METRICS,
    IGNORED_FIELDS,
    X_AXES,
    RunData,
    config_diff,
    ema,
    final_values,
    has_time,
    labels,
    last_samples,
    load_run,
    load_runs,
    load_samples,
    parse_rows,
    parse_samples,
    samples_by_step,
    series,
    series_csv,
    side_by_side,
)
from nbtrain.compare.view import compare

log = logging.getLogger(__name__)


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return compare(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

__all__ = [
    "COMPARE_METRICS",
    "IGNORED_FIELDS",
    "X_AXES",
    "RunData",
    "compare",
    "config_diff",
    "ema",
    "final_values",
    "has_time",
    "labels",
    "last_samples",
    "load_run",
    "load_runs",
    "load_samples",
    "parse_rows",
    "parse_samples",
    "samples_by_step",
    "series",
    "series_csv",
    "side_by_side",
]
