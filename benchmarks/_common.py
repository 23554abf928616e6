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
# raw results (JSON) of the committed runs; the scripts and RESULTS.md stay at the top
RESULTS = HERE / "results"


def process_start() -> float:
    """This process's start as a wall-clock time: /proc/self/stat's start time (clock ticks since
    boot) against CLOCK_BOOTTIME, exact to a tick (psutil's create_time rounds the boot time to a
    whole second). Interpreter start-up is inside it."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    since_start = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - since_start


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


def median_ci(xs: list[float], conf: float = 0.9) -> tuple[float, float] | None:
    """Distribution-free confidence interval of the median (order statistics, binomial tails).

    With n paired ratios, the interval [x(k), x(n-k+1)] covers the true median with probability at
    least `conf`; nothing is assumed about how the VM's noise is distributed.
    """
    from math import comb

    n = len(xs)
    s = sorted(xs)
    tail = (1 - conf) / 2
    k, cum = 0, 0.0
    # the largest k with P(Binomial(n, 1/2) < k) <= tail
    while k < n and cum + comb(n, k) / 2**n <= tail:
        cum += comb(n, k) / 2**n
        k += 1
    if k == 0:
        return None  # too few rounds for this confidence
    return s[k - 1], s[n - k]


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


class StepClock:
    """When each optimizer step of an HF Trainer run ended, for tokens/s after a warm-up.

    Pass `callback()` to `Trainer(callbacks=[...])`; at each step's end it waits for the GPU (when
    there is one, so the step's kernels count) and records `time.perf_counter()` in `times`.
    `window(warmup)` gives the steps after the first `warmup` and the seconds they took: from the end
    of step `warmup` to the end of the last step (`warmup` must be at least 1).
    """

    def __init__(self) -> None:
        self.times: list[float] = []

    def callback(self) -> Any:
        import torch
        from transformers import TrainerCallback

        on_gpu = torch.cuda.is_available()
        times = self.times

        class Clock(TrainerCallback):
            def on_step_end(self, *a: Any, **k: Any) -> None:
                if on_gpu:
                    torch.cuda.synchronize()
                times.append(time.perf_counter())

        return Clock()

    def window(self, warmup: int) -> tuple[int, float]:
        """(steps after the warm-up, their seconds)."""
        return len(self.times) - warmup, self.times[-1] - self.times[warmup - 1]


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


class CpuMeter:
    """CPU seconds used by process trees while the ranks train, split into rank and launcher shares.

    Wall-clock tokens/s on a shared 2-core VM swings by up to 2x between runs; CPU time does not:
    what the launcher side (torchrun's agent; nbtrain's controller, nanny, watchdog and the kernel
    that draws the live display) burns while the ranks train is taken from the ranks' two cores, so
    its share bounds the launcher's cost whatever the noise. A thread samples every tree each
    `every` seconds with psutil's per-thread times, and counts the rows of the run's metrics.jsonl:
    the report covers the samples from the one where `from_rows` rows were written to the one where
    the last row was, the same window the tokens/s figure covers (start-up and imports left out).
    """

    def __init__(self, roots: list[int], metrics: Path, ranks: int = 2, every: float = 0.2) -> None:
        import threading

        self.roots, self.metrics, self.ranks, self.every = roots, metrics, ranks, every
        # (time, rows written, {(pid, tid): (cmd, main|thread, cpu seconds)})
        self.series: list[tuple[float, int, dict[tuple[int, int], tuple[str, str, float]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _rows(self) -> int:
        try:
            return self.metrics.read_bytes().count(b"\n")
        except OSError:
            return 0

    def _sample(self) -> None:
        import psutil

        seen: dict[tuple[int, int], tuple[str, str, float]] = {}
        procs = []
        for pid in self.roots:
            try:
                p = psutil.Process(pid)
                procs += [p, *p.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
        for p in procs:
            try:
                cmd = " ".join(p.cmdline())
                for t in p.threads():
                    kind = "main" if t.id == p.pid else "thread"
                    seen[(p.pid, t.id)] = (cmd, kind, t.user_time + t.system_time)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        self.series.append((time.perf_counter(), self._rows(), seen))

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            self._sample()

    def __enter__(self) -> CpuMeter:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def report(self, from_rows: int) -> dict[str, Any]:
        """CPU seconds and shares over the training window: rank main threads, rank side threads, the rest."""
        final = self.series[-1][1]
        first = next(i for i, s in enumerate(self.series) if s[1] >= min(from_rows, final))
        last = next(i for i, s in enumerate(self.series) if s[1] >= final)
        if last <= first:
            return {"window_s": 0.0, "outside_ranks_share_of_machine": None}
        t0, _, start = self.series[first]
        t1 = self.series[last][0]
        end: dict[tuple[int, int], tuple[str, str, float]] = {}
        for _, _, snap in self.series[first : last + 1]:
            end.update(snap)  # a process that exited keeps its last sample
        used: dict[int, dict[str, float]] = {}
        cmds: dict[int, str] = {}
        for key, (cmd, kind, t) in end.items():
            d = t - (start[key][2] if key in start else 0.0)
            if d <= 0:
                continue
            used.setdefault(key[0], {"main": 0.0, "thread": 0.0})[kind] += d
            cmds[key[0]] = cmd
        # the ranks are the processes that trained: the busiest main threads
        ranks = sorted(used, key=lambda p: used[p]["main"], reverse=True)[: self.ranks]
        outside = {p: used[p]["main"] + used[p]["thread"] for p in used if p not in ranks}
        total_out = sum(outside.values())
        window = t1 - t0
        top = sorted(outside.items(), key=lambda kv: kv[1], reverse=True)[:4]
        return {
            "window_s": round(window, 2),
            "rank_main_cpu_s": round(sum(used[p]["main"] for p in ranks), 3),
            "rank_side_threads_cpu_s": round(sum(used[p]["thread"] for p in ranks), 3),
            "outside_ranks_cpu_s": round(total_out, 3),
            # the share of the machine's capacity (all its cores) the launcher side took
            "outside_ranks_share_of_machine": round(
                total_out / (window * (os.cpu_count() or 1)), 4
            ),
            "outside_top": [(cmds[p][-70:], round(s, 3)) for p, s in top],
        }
