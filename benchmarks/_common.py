"""Helpers shared by the benchmark scripts: statistics, machine load, where scratch files go, JSON out.

The benchmarks compare variants side by side in one run, interleaved (A, B, C, A, B, C, ...), so a
shared machine's load drifts over all of them alike; they report medians, and the load at start and end.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# ignored by git (.gitignore): models, run folders, the runs registry the benchmarks write
WORK = HERE / "_work"


def setup_env() -> None:
    """Keep the benchmarks' runs registry out of the user's home; make scratch space."""
    WORK.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("NBTRAIN_HOME", str(WORK / "home"))


def python() -> str:
    return sys.executable


def bin_path(name: str) -> str:
    """A console script next to this interpreter (torchrun, ...)."""
    return str(Path(sys.executable).with_name(name))


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "host": platform.node(),
    }


def code_version() -> dict[str, Any]:
    """The commit measured, and whether nbtrain/ had uncommitted changes (others may edit the tree)."""
    import subprocess

    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10
            ).stdout.rstrip("\n")
        except Exception:
            return ""

    dirty = git("status", "--porcelain", "--", "nbtrain")
    return {
        "commit": git("rev-parse", "--short", "HEAD").strip(),
        "nbtrain_dirty_files": [line for line in dirty.splitlines() if line.strip()],
    }


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def quantile(xs: list[float], q: float) -> float | None:
    """Nearest-rank quantile (q in 0..1): an observed value, not an interpolation."""
    if not xs:
        return None
    s = sorted(xs)
    k = max(0, min(len(s) - 1, int(round(q * len(s) + 0.5)) - 1))
    return s[k]


def summary(xs: list[float]) -> dict[str, Any]:
    return {
        "n": len(xs),
        "median": median(xs),
        "p90": quantile(xs, 0.9),
        "min": min(xs) if xs else None,
        "max": max(xs) if xs else None,
    }


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


class Recorder:
    """Collects one benchmark's results: load at start and end, metrics, free-form details."""

    def __init__(self, name: str, quick: bool) -> None:
        self.name = name
        self.data: dict[str, Any] = {
            "benchmark": name,
            "quick": quick,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "machine": machine(),
            "code": code_version(),
            "loadavg_start": loadavg(),
        }
        self.metrics: list[dict[str, Any]] = []
        self.t0 = time.monotonic()

    def metric(
        self,
        name: str,
        nbtrain: float | None,
        baseline: float | None,
        baseline_name: str,
        unit: str,
        target: str,
        ratio_value: float | None = None,
        note: str = "",
    ) -> None:
        """One row of RESULTS.md: nbtrain's figure against a baseline's, and their ratio."""
        self.metrics.append(
            {
                "metric": name,
                "nbtrain": nbtrain,
                "baseline": baseline,
                "baseline_name": baseline_name,
                "unit": unit,
                "ratio": ratio_value if ratio_value is not None else ratio(nbtrain, baseline),
                "target": target,
                "note": note,
            }
        )

    def finish(self, out: str | None) -> dict[str, Any]:
        self.data["loadavg_end"] = loadavg()
        self.data["wall_s"] = round(time.monotonic() - self.t0, 1)
        self.data["metrics"] = self.metrics
        text = json.dumps(self.data, indent=2, default=str)
        if out:
            Path(out).write_text(text + "\n")
        print(text)
        return self.data


def last_json_line(text: str) -> dict[str, Any]:
    """The last line of a child's stdout that parses as a JSON object (its report)."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    msg = f"no JSON report in the child's output:\n{text[-2000:]}"
    raise RuntimeError(msg)
