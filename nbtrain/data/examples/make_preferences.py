"""Regenerate `preferences.jsonl`, the small preference dataset nbtrain ships for DPO demos and tests.

    python -m nbtrain.data.examples.make_preferences

Deterministic (fixed seed). Each pair takes a task of `instructions.jsonl` (reverse a word, add two
numbers, ...): its right answer is chosen, the answer of another task rejected. Rows cycle through
TRL's three preference layouts: prompt/chosen/rejected strings, the same as conversations, and
chosen/rejected strings with the prompt implicit (their common prefix).
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

from nbtrain.data.examples.make_instructions import make_rows

log = logging.getLogger(__name__)

N_ROWS = 240
SEED = 1


def _task(row: dict) -> tuple[str, str]:
    if "prompt" in row:
        return row["prompt"].removesuffix("\nAnswer: "), row["completion"]
    user = [m for m in row["messages"] if m["role"] == "user"][0]
    answer = [m for m in row["messages"] if m["role"] == "assistant"][0]
    return user["content"], answer["content"]


def make_pairs(n: int = N_ROWS, seed: int = SEED) -> list[dict]:
    """The pairs: the right answer chosen, another task's answer rejected."""
    rng = random.Random(seed)
    tasks = [_task(r) for r in make_rows(n, seed)]
    answers = sorted({a for _, a in tasks})
    rows: list[dict] = []
    for i, (prompt, answer) in enumerate(tasks):
        wrong = rng.choice([a for a in answers if a != answer])
        if i % 3 == 0:
            rows.append(
                {"prompt": f"{prompt}\nAnswer:", "chosen": f" {answer}", "rejected": f" {wrong}"}
            )
        elif i % 3 == 1:
            rows.append(
                {
                    "prompt": [{"role": "user", "content": prompt}],
                    "chosen": [{"role": "assistant", "content": answer}],
                    "rejected": [{"role": "assistant", "content": wrong}],
                }
            )
        else:
            rows.append(
                {"chosen": f"{prompt}\nAnswer: {answer}", "rejected": f"{prompt}\nAnswer: {wrong}"}
            )
    return rows


def main() -> None:
    path = Path(__file__).with_name("preferences.jsonl")
    with path.open("w") as f:
        for row in make_pairs():
            f.write(json.dumps(row) + "\n")
    print(f"wrote {N_ROWS} pairs to {path}")


if __name__ == "__main__":
    main()
