"""scripts/lanes.sh, which `make test` runs its two lanes with: both run at once, each lane's output
is printed whole (never interleaved with the other's), and a failed lane fails the whole, after the
other has ended."""

from __future__ import annotations

import signal
import subprocess
import sys
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


def test_a_lane_can_be_interrupted():
    # a background command of a plain script starts with SIGINT ignored; a lane must not, or the
    # tests that interrupt a cell (_thread.interrupt_main) find no KeyboardInterrupt to raise
    code = "import signal; print('SIGINT', signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    out = _lanes("py", f'{sys.executable} -c "{code}"', "other", "true")
    assert out.returncode == 0, out.stderr
    assert "SIGINT True" in out.stdout, out.stdout


def test_stopping_the_lanes_stops_every_lane(tmp_path):
    marker = tmp_path / "left"
    proc = subprocess.Popen(
        ["bash", str(LANES), "a", f"sleep 30; touch {marker}", "b", f"sleep 30; touch {marker}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=10) == 130
    # the lanes' own processes went with it: nothing runs on to the touch
    left = subprocess.run(["pgrep", "-f", f"touch {marker}"], capture_output=True, text=True)
    assert left.stdout.strip() == "", left.stdout
