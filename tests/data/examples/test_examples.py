"""The datasets nbtrain ships (nbtrain/data/examples/): each committed file is what its generator
writes, byte for byte, and holds the rows its docstring promises."""

from __future__ import annotations

import json

from nbtrain.data import examples
from nbtrain.data.examples import make_instructions, make_preferences


def _jsonl(rows: list[dict]) -> str:
    # as the generators' main() writes the file
    return "".join(json.dumps(row) + "\n" for row in rows)


def test_the_instructions_are_what_make_instructions_writes():
    rows = make_instructions.make_rows()
    assert examples.INSTRUCTIONS.read_text() == _jsonl(rows)
    assert len(rows) == make_instructions.N_ROWS == 400
    # the two TRL formats that carry a loss mask, alternately, some chats with a system turn
    assert all(("prompt" in r) == (i % 2 == 0) for i, r in enumerate(rows))
    assert any(r.get("messages", [{}])[0].get("role") == "system" for r in rows)


def test_the_preferences_are_what_make_preferences_writes():
    pairs = make_preferences.make_pairs()
    assert examples.PREFERENCES.read_text() == _jsonl(pairs)
    assert len(pairs) == make_preferences.N_ROWS == 240
    assert all(p["chosen"] != p["rejected"] for p in pairs)


def test_the_paths_are_the_shipped_files():
    assert examples.instructions_path() == str(examples.INSTRUCTIONS)
    assert examples.preferences_path() == str(examples.PREFERENCES)
    assert examples.INSTRUCTIONS.parent == examples.PREFERENCES.parent
