"""Regenerate `instructions.jsonl`, the small instruction dataset nbtrain ships for demos and tests.

    python -m nbtrain.data.examples.make_instructions

Deterministic (fixed seed), so the committed file is reproducible byte for byte. The tasks are simple and
rule-based (reverse a word, upper-case it, add two small numbers, name a colour's opposite...) so that a
tiny model built from a config visibly lowers its loss within 50-100 steps. Rows mix the two TRL formats
that carry a loss mask: prompt/completion and chat `messages`.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

log = logging.getLogger(__name__)

N_ROWS = 400
SEED = 0

WORDS = (
    "cat dog sun moon tree bird fish star rain snow lamp book cake milk road ship coin rose wolf frog "
    "bell leaf ring door king salt gold lake hill wind"
).split()
OPPOSITES = {
    "hot": "cold",
    "big": "small",
    "up": "down",
    "day": "night",
    "fast": "slow",
    "old": "new",
    "open": "closed",
    "left": "right",
    "wet": "dry",
    "light": "dark",
    "full": "empty",
    "high": "low",
}
COLOURS = {
    "sky": "blue",
    "grass": "green",
    "snow": "white",
    "coal": "black",
    "sun": "yellow",
    "blood": "red",
    "orange": "orange",
    "cloud": "grey",
}
SYSTEM = "You are a helpful assistant. Answer briefly."


def _task(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(6)
    if kind == 0:
        w = rng.choice(WORDS)
        return f"Reverse the word: {w}", w[::-1]
    if kind == 1:
        w = rng.choice(WORDS)
        return f"Write in capitals: {w}", w.upper()
    if kind == 2:
        a, b = rng.randrange(10), rng.randrange(10)
        return f"What is {a} plus {b}?", str(a + b)
    if kind == 3:
        w = rng.choice(sorted(OPPOSITES))
        return f"What is the opposite of {w}?", OPPOSITES[w]
    if kind == 4:
        w = rng.choice(sorted(COLOURS))
        return f"What colour is the {w}?", COLOURS[w]
    w = rng.choice(WORDS)
    n = rng.randrange(2, 4)
    return f"Repeat {w} {n} times.", " ".join([w] * n)


def make_rows(n: int = N_ROWS, seed: int = SEED) -> list[dict]:
    """The dataset's rows: alternately prompt/completion and messages (some with a system turn)."""
    rng = random.Random(seed)
    rows: list[dict] = []
    for i in range(n):
        prompt, answer = _task(rng)
        if i % 2 == 0:
            rows.append({"prompt": f"{prompt}\nAnswer: ", "completion": answer})
        else:
            messages = [
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": answer},
            ]
            if i % 4 == 1:
                messages.insert(0, {"role": "system", "content": SYSTEM})
            rows.append({"messages": messages})
    return rows


def main() -> None:
    path = Path(__file__).with_name("instructions.jsonl")
    with path.open("w") as f:
        for row in make_rows():
            f.write(json.dumps(row) + "\n")
    print(f"wrote {N_ROWS} rows to {path}")


if __name__ == "__main__":
    main()
