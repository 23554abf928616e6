"""The scaling model and verdict (nbtrain/cluster/scaling/model.py) and the report
(nbtrain/cluster/scaling/report.py) on synthetic measurements whose answers are known by hand."""

from __future__ import annotations

import json

import pytest

from nbtrain.cluster.scaling.model import (
    check_predict,
    efficiencies,
    fit,
    parse_sizes,
    predict,
    ring_bytes_factor,
    verdict,
)
from nbtrain.cluster.scaling.report import ScalingReport
from nbtrain.errors import ConfigError


def measured(
    sizes=(1, 2, 4),
    compute=1.0,
    tokens=1000.0,
    grad=1e8,
    busbw=1e9,
    latency=1e-4,
    comm_scale=1.0,
    mode="weak",
):
    """Rows as a run would measure them if steps were exactly compute + ring all-reduce."""
    rows = []
    for n in sizes:
        comm = comm_scale * (ring_bytes_factor(n) * grad / busbw + latency) if n > 1 else 0.0
        c = compute if mode == "weak" else compute / n
        step = c + comm
        step_tokens = tokens * n if mode == "weak" else tokens
        rows.append(
            {
                "nodes": n,
                "ranks": n,
                "predicted": False,
                "step_s": step,
                "comm_s": comm,
                "compute_s": c,
                "tokens_per_s": step_tokens / step,
                "tokens_per_s_per_rank": step_tokens / step / n,
                "busbw": busbw,
                "latency_s": latency,
                "grad_bytes": grad,
                "allreduces_per_step": 1.0,
                "assumptions": "measured",
            }
        )
    efficiencies(rows)
    return rows


def test_ring_factor():
    assert ring_bytes_factor(1) == 0.0
    assert ring_bytes_factor(2) == 1.0
    assert ring_bytes_factor(4) == 1.5
    assert ring_bytes_factor(8) == 1.75


def test_efficiencies_follow_from_tokens_per_s():
    rows = measured()
    # weak scaling: each rank does the same work; the step grows by the all-reduce
    assert rows[0]["efficiency"] == pytest.approx(1.0)
    assert rows[1]["efficiency"] == pytest.approx(1.0 / 1.1001)
    assert rows[2]["efficiency"] == pytest.approx(1.0 / 1.1501)
    for r in rows:
        base = rows[0]["tokens_per_s"] * r["nodes"]
        assert r["efficiency"] == pytest.approx(r["tokens_per_s"] / base)


def test_fit_recovers_compute_tokens_and_the_comm_factor():
    m = fit(measured(), "weak")
    assert m.compute_s == pytest.approx(1.0)
    assert m.tokens_per_step == pytest.approx(1000.0)
    assert m.comm_fit == pytest.approx(1.0)
    # all-reduces that take twice what the probe's figures say: the fit says so
    assert fit(measured(comm_scale=2.0), "weak").comm_fit == pytest.approx(2.0)
    strong = fit(measured(compute=4.0, tokens=4000.0, mode="strong"), "strong")
    assert strong.compute_s == pytest.approx(4.0)  # the global batch on one rank
    assert strong.compute_at(4) == pytest.approx(1.0)
    assert strong.tokens_at(8) == pytest.approx(4000.0)


def test_predicted_rows_are_marked_and_follow_the_model():
    m = fit(measured(), "weak")
    rows = predict(m, [8, 16], 1, 1e9, 1e-4, "as measured at 4 nodes:")
    assert [r["nodes"] for r in rows] == [8, 16]
    assert all(r["predicted"] for r in rows)
    assert all(
        r["assumptions"].startswith("predicted: as measured at 4 nodes: busbw 1 GB/s") for r in rows
    )
    step8 = 1.0 + 1.75 * 0.1 + 1e-4
    assert rows[0]["step_s"] == pytest.approx(step8)
    assert rows[0]["tokens_per_s"] == pytest.approx(8000.0 / step8)
    efficiencies(rows, base=measured()[0])
    assert rows[0]["efficiency"] == pytest.approx(1.0 / step8)
    # two ranks per node: 8 nodes are 16 ranks
    assert predict(m, [8], 2, 1e9, 1e-4, "given")[0]["ranks"] == 16


def test_verdicts():
    fast = measured(busbw=1e10)  # all-reduce 1.5% of a step
    v = verdict(fast, fit(fast, "weak"))
    assert v.limit == "compute-bound" and v.near_linear
    assert v.line.startswith("near-linear: efficiency 0.99")

    slow = measured(busbw=1e8)  # the all-reduce as long as the compute
    v = verdict(slow, fit(slow, "weak"))
    assert v.limit == "bandwidth-bound" and not v.near_linear
    assert v.comm_share == pytest.approx(1.5001 / 2.5001)
    assert any("faster interconnect" in a for a in v.advice)
    assert any("gradient accumulation" in a for a in v.advice)

    chatty = measured(grad=1e3, latency=0.5)
    v = verdict(chatty, fit(chatty, "weak"))
    assert v.limit == "latency-bound"
    assert any("bucket_cap_mb" in a for a in v.advice)

    # compute-bound, yet not near-linear: the compute itself grew (ranks sharing one machine's cores)
    crowded = measured(busbw=1e10)
    crowded[2]["compute_s"] *= 1.5
    crowded[2]["step_s"] += 0.5
    crowded[2]["tokens_per_s"] = 4000 / crowded[2]["step_s"]
    efficiencies(crowded)
    v = verdict(crowded, fit(crowded, "weak"))
    assert v.limit == "compute-bound" and not v.near_linear
    assert v.advice[0].startswith(
        "the all-reduce is not the limit, compute is: a step's compute took 1.5 s"
    )

    # the same numbers pass a lower bar
    assert verdict(slow, fit(slow, "weak"), threshold=0.3).near_linear

    tcp = "bus bandwidth 0.10 GB/s is far below ...: NCCL probably fell back to TCP sockets."
    v = verdict(slow, fit(slow, "weak"), warnings=[tcp])
    assert v.advice[-1] == "fix the TCP fallback probe reported: " + tcp


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("1,0", "sizes start at 1"),
        ("1,x", "not a whole number"),
        ("2,2", "names a size twice"),
        ("", "not a whole number"),
    ],
)
def test_bad_sizes_are_refused(text, words):
    with pytest.raises(ConfigError, match=words):
        parse_sizes(text)


def test_sizes_are_sorted_and_predict_must_lie_past_them():
    assert parse_sizes("4,1,2") == [1, 2, 4]
    assert parse_sizes([2, 1]) == [1, 2]
    check_predict([8, 16], [1, 2, 4])
    with pytest.raises(ConfigError, match="not past the largest measured size"):
        check_predict([4, 8], [1, 2, 4])
    with pytest.raises(ConfigError, match="choose weak"):
        fit(measured(), "medium")


def test_report_table_plot_and_files(tmp_path):
    rows = measured()
    m = fit(rows, "weak")
    extra = predict(m, [8], 1, 1e9, 1e-4, "as measured at 4 nodes:")
    efficiencies(extra, base=rows[0])
    v = verdict(rows, m)
    report = ScalingReport(
        rows + extra, "weak", "nodes", "4 node(s) (a, b, c, d), test CPU", v, m, 0.9
    )
    t = report.table
    assert list(t["kind"]) == ["measured", "measured", "measured", "predicted"]
    assert list(t["nodes"]) == [1, 2, 4, 8]
    assert t["assumptions"].iloc[-1].startswith("predicted:")
    out = report.save(tmp_path / "rep")
    assert sorted(p.name for p in out.iterdir()) == ["scaling.json", "scaling.md", "scaling.png"]
    assert (out / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the notebook plots' look: within the output area, transparent, a tick at every size,
    # efficiency from 0 to a tick at or above 1
    from PIL import Image

    from nbtrain import plots

    img = Image.open(out / "scaling.png")
    assert img.size[0] <= plots.MAX_WIDTH_PX and img.mode == "RGBA" and img.getpixel((0, 0))[3] == 0
    fig = report.figure()
    ax_t, ax_e = fig.axes
    assert [t.get_text() for t in ax_t.get_xticklabels()] == ["1", "2", "4", "8"]
    assert ax_e.get_ylim()[0] == 0 and ax_e.get_ylim()[1] >= 1.0
    assert ax_e.get_ylim()[1] in ax_e.get_yticks()
    assert ax_t.get_lines()[1].get_color() == plots.PALETTE_LIGHT[0]
    md = (out / "scaling.md").read_text()
    assert "Machine: 4 node(s) (a, b, c, d), test CPU" in md
    assert v.line in md and "| predicted |" in md
    data = json.loads((out / "scaling.json").read_text())
    assert [r["predicted"] for r in data["rows"]] == [False, False, False, True]
    assert data["verdict"]["limit"] == v.limit and data["machine"].startswith("4 node(s)")


def test_report_table_keeps_counts_as_integers_when_a_predicted_size_has_no_node_count():
    # measured in ranks on one node, predicted at 8 ranks: the prediction knows no node count
    rows = measured(sizes=(1, 2, 4))
    for r in rows:
        r["nodes"] = 1
    m = fit(rows, "weak")
    extra = predict(m, [8], 1, 1e9, 1e-4, "as measured at 4 ranks:", unit="ranks")
    efficiencies(extra, unit="ranks", base=rows[0])
    report = ScalingReport(
        rows + extra, "weak", "ranks", "1 node, test CPU", verdict(rows, m), m, 0.9
    )
    t = report.table
    assert str(t["nodes"].dtype) == "Int64" and str(t["ranks"].dtype) == "Int64"
    assert list(t["ranks"]) == [1, 2, 4, 8]
    assert list(t["nodes"][:3]) == [1, 1, 1] and t["nodes"].isna().tolist() == [False] * 3 + [True]
    shown = t[["nodes", "ranks"]].to_string()
    assert "1.0" not in shown and "NaN" not in shown and "<NA>" in shown
