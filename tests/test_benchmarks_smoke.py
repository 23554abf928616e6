"""Smoke test of benchmarks/bench_cell.py --quick: it runs end to end on real engines and reports numbers.

Speed itself is judged in benchmarks/RESULTS.md, never here: no timing asserts.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_cell.py"


@pytest.mark.timeout(60)
def test_bench_cell_quick_reports_numbers(tmp_path):
    out = tmp_path / "cell.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=55,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["quick"] is True
    for variant in ("nbtrain", "raw"):
        s = report["summary_ms"][variant]
        assert s["n"] == report["runs"] == 20
        assert math.isfinite(s["median"]) and s["median"] > 0
        assert s["min"] <= s["median"] <= s["p90"] <= s["max"]
    names = [m["metric"] for m in report["metrics"]]
    assert any("median" in n for n in names)
    for m in report["metrics"]:
        assert m["ratio"] == pytest.approx(m["nbtrain"] / m["baseline"])
    # the breakdown covers CellRun's steps, and the load was recorded at both ends
    assert "nbtrain: AsyncResult.wait (reply from both engines)" in report["phases_ms"]
    assert len(report["loadavg_start"]) == 3 and len(report["loadavg_end"]) == 3


BENCH_GPU = BENCH.parent / "bench_gpu.py"


@pytest.mark.timeout(300)
def test_bench_gpu_runs_its_three_arms_on_the_cpu(tmp_path):
    """bench_gpu.py --shape tiny: the same code the H100 runs, end to end on CPU engines (no timing
    asserts): every arm reports tokens/s, the record lands in the JSON file, the GPU table skips it."""
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH_GPU), "--shape", "tiny", "--seq", "64", "--steps", "4"]
        + ["--warmup", "2", "--no-compile", "--json", str(out), "--no-render"],
        capture_output=True,
        text=True,
        timeout=290,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    [record] = json.loads(out.read_text())["runs"]
    assert record["device"] == "cpu" and record["shape"] == "tiny"
    for arm in ("nbtrain_tok_s", "hf_trainer_tok_s", "bare_tok_s"):
        assert math.isfinite(record[arm]) and record[arm] > 0, record
    assert record["nbtrain_vs_hf"] == pytest.approx(
        record["nbtrain_tok_s"] / record["hf_trainer_tok_s"]
    )
    assert record["batch"] == 4 and record["micro_batch"] >= 1
    assert "loss chunked" in record["levers"]
    sys.path.insert(0, str(BENCH.parent))
    import bench_gpu

    assert "tiny" not in bench_gpu.gpu_table({"runs": [record]})


BENCH_GENERATE = BENCH.parent / "bench_generate.py"


@pytest.mark.timeout(180)
def test_bench_generate_quick_reports_a_ratio_for_each_arm(tmp_path):
    """bench_generate.py --quick: a 2-engine cluster, every arm timed, the same tokens generated."""
    out = tmp_path / "generate.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH_GENERATE), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["quick"] is True
    # every prompt came back, each with exactly the new tokens asked for
    assert report["generated_rows_and_tokens"] == [
        report["prompts"],
        report["prompts"] * report["new_tokens"],
    ]
    for arm in ("nbtrain2", "nbtrain1", "hf1", "hf2"):
        assert report["seconds"][arm]["median"] > 0
    for m in report["metrics"]:
        assert m["ratio"] == pytest.approx(m["nbtrain"] / m["baseline"])


BENCH_TINKER = BENCH.parent / "bench_tinker.py"


@pytest.mark.timeout(240)
def test_bench_tinker_quick_reports_every_arm(tmp_path):
    """bench_tinker.py --quick: the SDK loop, nbtrain's SFT recipe and the service's calls without HTTP
    on one 2-engine cluster, each with tokens/s, and the round trips timed (no timing asserts)."""
    pytest.importorskip("tinker")
    out = tmp_path / "tinker.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH_TINKER), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=230,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["settings"]["quick"] is True
    for arm in ("nbtrain", "sdk", "direct"):
        (run,) = report["arms"][arm]
        assert math.isfinite(run["tokens_per_s"]) and run["tokens_per_s"] > 0, report["arms"]
    sdk, nbtrain = (report["arms"][a][0]["tokens_per_s"] for a in ("sdk", "nbtrain"))
    assert report["ratio_sdk_over_nbtrain"] == pytest.approx(sdk / nbtrain)
    for trip in ("healthz_ms", "forward_1_token_ms", "execute_empty_ms"):
        assert report["round_trip"][trip]["median"] > 0
    assert "Where a step's time goes" in proc.stdout
