"""Smoke test of benchmarks/bench_data.py --quick: every arm (nbtrain on 2 ranks cold and warm, on
1 process, TRL cold and warm) runs end to end on 2,000 generated rows and reports numbers.

How fast is judged in benchmarks/RESULTS.md, never here: no timing asserts.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_data.py"
ARMS = ("nbtrain_2r_cold", "nbtrain_2r_warm", "nbtrain_1p_cold", "trl_cold", "trl_warm")


def _positive(x: object) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def _bench_module():
    spec = importlib.util.spec_from_file_location("bench_data", BENCH)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCH.parent))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(BENCH.parent))
    return mod


@pytest.mark.timeout(420)
def test_bench_data_quick_reports_every_arm(tmp_path):
    pytest.importorskip("trl")
    out = tmp_path / "data.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=410,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["quick"] is True
    assert list(report["sizes"]) == ["2000"]
    size = report["sizes"]["2000"]
    assert size["data"]["rows"] == 2000
    # the generator aims at ~244 tokens a row with its 32k tokenizer
    assert 150 < size["data"]["tokens_per_row"] < 350
    for arm in ARMS:
        (run,) = size["runs"][arm]
        ranks = 2 if "_2r_" in arm else 1
        assert len(run["start_to_first_step_per_rank_s"]) == ranks, arm
        assert len(run["peak_rss_per_rank_bytes"]) == ranks, arm
        for key in ("start_to_first_step_s", "launch_to_first_step_s", "peak_rss_bytes"):
            assert _positive(run[key]), (arm, key, run[key])
        assert all(_positive(x) for x in run["start_to_first_step_per_rank_s"]), arm
        summary = size["summary"][arm]
        assert _positive(summary["start_to_first_step_s"]), arm
        assert _positive(summary["peak_rss_bytes"]), arm
        # TRL always keeps a datasets cache; nbtrain does once SFTConfig has data_cache
        if arm.startswith("trl") or report["nbtrain_data_cache_field"]:
            assert _positive(summary["cache_bytes_per_token"]), (arm, summary)
    ratios = size["summary"]["ratios"]
    for key in ("cold_2r_over_trl_cold", "warm_2r_over_trl_warm", "cold_1p_over_trl_cold"):
        assert _positive(ratios[key]), (key, ratios)
    assert len(report["loadavg_start"]) == 3 and len(report["loadavg_end"]) == 3

    # the RESULTS.md section: a table row for the size, written between markers, replaced in place
    bench = _bench_module()
    md = tmp_path / "RESULTS.md"
    md.write_text("# results\n")
    bench.render_results(report, md)
    bench.render_results(report, md)
    text = md.read_text()
    assert text.count(bench.BEGIN) == 1 and text.count("## Data set-up") == 1
    assert "| 2,000 (0.5M) |" in text
