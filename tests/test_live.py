"""The live display's curves: loss and tokens/s, and DPO's reward margin once the rows have it."""

from __future__ import annotations

from nbtrain.live import LiveDisplay


def _fed(rows):
    live = LiveDisplay(min_interval=1e9)
    live.feed({"kind": "begin", "total_steps": 4, "name": "run"})
    for row in rows:
        live.feed({"kind": "row", "row": row})
    return live


def test_sft_rows_draw_two_curves():
    live = _fed([{"step": s, "loss": 1.0 / s, "tokens_per_s": 100.0} for s in (1, 2, 3)])
    svg = live._svg()
    assert "width='660'" in svg and "reward margin" not in svg
    assert len(live._plots()) == 2


def test_dpo_rows_add_the_reward_margin():
    rows = [
        {"step": s, "loss": 0.69 - 0.01 * s, "tokens_per_s": 100.0, "rewards/margins": 0.1 * s}
        for s in (1, 2, 3)
    ]
    live = _fed(rows)
    svg = live._svg()
    assert "width='990'" in svg and "reward margin" in svg
    assert svg.count("<polyline") == 3
    png = live._png()
    assert png is not None and png[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(live._axes) == 3


def test_grpo_rows_add_the_mean_reward():
    rows = [
        {"step": s, "loss": 0.0, "tokens_per_s": 100.0, "reward": 0.1 * s, "gen_s": 0.1}
        for s in (1, 2, 3)
    ]
    live = _fed(rows)
    svg = live._svg()
    assert "width='990'" in svg and ">reward<" in svg and "reward margin" not in svg
    assert svg.count("<polyline") == 3
