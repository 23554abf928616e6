"""scripts/lanes.sh, which `make test` runs its two lanes with: both run at once, each lane's output
is printed whole (never interleaved with the other's), and a failed lane fails the whole, after the
other has ended."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

LANES = Path(__file__).resolve().parent.parent / "scripts" / "lanes.sh"


def _lanes(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(LANES), *args], capture_output=True, text=True, timeout=60)


def test_lanes_run_at_once_and_print_whole():
    t0 = time.monotonic()
    out = _lanes(
        "slow",
        "for i in 1 2 3; do echo slow-$i; sleep 0.4; done",
        "fast",
        "for i in 1 2 3; do echo fast-$i; sleep 0.1; done",
    )
    took = time.monotonic() - t0
    assert out.returncode == 0, out.stderr
    # at once: the whole is the slow lane's 1.2 s, not the sum
    assert took < 1.2 + 0.3 + 1.0, took
    text = out.stdout
    # each lane whole, the one that ended first first
    fast = text.index("fast-1\nfast-2\nfast-3\n")
    slow = text.index("slow-1\nslow-2\nslow-3\n")
    assert fast < slow
    assert "end of lane fast: passed" in text and "end of lane slow: passed" in text


def test_a_failed_lane_fails_the_whole_after_the_other_ends():
    out = _lanes("bad", "echo oops; exit 3", "good", "sleep 0.5; echo done")
    assert out.returncode == 1
    assert "lane bad (0s, exit 3)" in out.stdout and "oops" in out.stdout
    # the other lane still ran to its end, and its output is there
    assert "done" in out.stdout and "end of lane good: passed" in out.stdout
    assert "lanes failed: bad" in out.stderr


def test_usage_is_refused():
    out = _lanes("only-a-name")
    assert out.returncode == 2 and "usage" in out.stderr
