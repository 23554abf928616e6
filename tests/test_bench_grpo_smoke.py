"""Smoke test of benchmarks/bench_grpo.py --quick: both placements (collocated, disaggregated) run GRPO
end to end on a 2-rank cluster and report steps/s and their time shares.

How fast is judged in benchmarks/RESULTS.md, never here: no timing asserts.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_grpo.py"


def _positive(x: object) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


@pytest.mark.timeout(300)
def test_bench_grpo_quick_reports_both_placements(tmp_path):
    out = tmp_path / "grpo.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=290,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["quick"] is True
    med = report["medians"]
    assert _positive(med["collocated"]["steps_per_s"])
    assert _positive(med["disaggregated"]["steps_per_s"])
    assert _positive(med["collocated"]["gen_share"]) and _positive(med["collocated"]["train_share"])
    # the disaggregated run measured both groups' waits (zero is possible, missing is not)
    for key in ("actor_wait_share", "rollout_wait_share"):
        assert isinstance(med["disaggregated"][key], float) and med["disaggregated"][key] >= 0
    assert report["metrics"][0]["unit"] == "steps/s"
    # the section run_all.py puts into RESULTS.md, added once and then replaced in place
    sys.path.insert(0, str(BENCH.parent))
    try:
        import bench_grpo
    finally:
        sys.path.remove(str(BENCH.parent))
    md = tmp_path / "RESULTS.md"
    md.write_text("# results\n")
    bench_grpo.render_results(report, md)
    bench_grpo.render_results(report, md)
    text = md.read_text()
    assert text.count(bench_grpo.SECTION) == 1 and text.count(bench_grpo.BEGIN) == 1
    assert "| disaggregated |" in text and "round by round" in text
