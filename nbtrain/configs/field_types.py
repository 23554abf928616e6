"""The type of each numeric setting, checked before its value: `SFTConfig(learning_rate="2e-4")` (text from
a YAML file or argv) is refused as a string, with the number to write, not as a value out of range.
SFTConfig, DPOConfig and GRPOConfig alike: every field annotated int or float is checked."""

from __future__ import annotations

import logging
from dataclasses import fields
from typing import Any

log = logging.getLogger(__name__)


def type_problems(cfg: Any) -> dict[str, str]:
    """Numeric settings of another type, by field: learning_rate="2e-4" (text from a YAML file or
    argv) is a string to fix, not a value out of range."""
    found = {}
    for f in fields(cfg):
        kinds = {k.strip() for k in str(f.type).split("|")}
        value, want = getattr(cfg, f.name), "a number" if "float" in kinds else "an integer"
        if not kinds & {"int", "float"} or value is None:
            continue
        if isinstance(value, str):
            try:  # the number the text holds, as it should have been written
                (float if "float" in kinds else int)(value)
                hint = f"; pass {f.name}={value.strip()} (no quotes)"
            except ValueError:  # text that is no number: a field that takes words ('auto') says so
                if "str" in kinds:
                    continue
                hint = ""
            found[f.name] = f"{f.name}={value!r} must be {want}, not a string{hint}"
        elif isinstance(value, bool) or (
            kinds <= {"int", "float", "None"} and not isinstance(value, int | float)
        ):
            found[f.name] = f"{f.name}={value!r} must be {want}, not a {type(value).__name__}"
    return found
