"""Data shipped with nbtrain: small instruction and preference datasets for demos and tests."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

#: 400 rows of simple instructions, prompt/completion and chat `messages` mixed
INSTRUCTIONS = Path(__file__).with_name("instructions.jsonl")
#: 240 preference pairs (TRL's formats: prompt/chosen/rejected strings and conversations, implicit prompts)
PREFERENCES = Path(__file__).with_name("preferences.jsonl")


def instructions_path() -> str:
    """The path of the shipped instruction dataset, ready for `SFTConfig(data=...)`."""
    return str(INSTRUCTIONS)


def preferences_path() -> str:
    """The path of the shipped preference dataset, ready for `DPOConfig(data=...)`."""
    return str(PREFERENCES)
