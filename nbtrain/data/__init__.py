"""Data shipped with nbtrain: a small instruction dataset for demos and tests."""

from __future__ import annotations

from pathlib import Path

#: 400 rows of simple instructions, prompt/completion and chat `messages` mixed
INSTRUCTIONS = Path(__file__).with_name("instructions.jsonl")


def instructions_path() -> str:
    """The path of the shipped instruction dataset, ready for `SFTConfig(data=...)`."""
    return str(INSTRUCTIONS)
