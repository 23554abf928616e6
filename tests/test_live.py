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
    # issue 34, 13: the progress line shows the mean reward, not only a loss near 0
    _, _, line = live._progress()
    assert "loss 0.0000 · reward 0.300 · " in line


def test_final_plot_and_table_read_like_the_lab_panel():
    # issue 28, 8: axis titles with units, the panel's number format on the axes, readable sizes,
    # and the final table's numbers in full (a learning rate of 1.5e-05 is not 0.0000)
    from nbtrain import live as live_mod

    live = LiveDisplay()
    live.feed({"kind": "begin", "total_steps": 3, "name": "run"})
    for step, lr in ((1, 1.5e-05), (2, 2e-4), (3, 1.25e-4)):
        live.feed(
            {
                "kind": "row",
                "row": {"step": step, "loss": 4.7, "tokens_per_s": 12_345.0, "learning_rate": lr},
            }
        )
    assert live._png() is not None
    loss_ax, tps_ax = live._axes
    assert (loss_ax.get_xlabel(), loss_ax.get_ylabel()) == ("step", "nats/token")
    assert tps_ax.get_ylabel() == "tokens/s"
    assert min(t.get_fontsize() for t in loss_ax.get_yticklabels()) >= 9
    labels = [t.get_text() for t in tps_ax.get_yticklabels() if t.get_text()]
    assert any(lbl.endswith("k") for lbl in labels), labels
    assert live_mod._fmt(1.5e-05) == "1.5e-05" and live_mod._fmt(0.0002) == "0.0002"
    assert live_mod._fmt(0.000123456789) == "0.000123457"
    assert (live_mod._tick(12_345.0), live_mod._tick(4.7), live_mod._tick(0.0)) == (
        "12.3k",
        "4.7",
        "0",
    )
    table = live._table_html()
    assert "0.000125" in table and "12345" in table


def _published(monkeypatch):
    """The payloads a run in this process publishes for its live display (what a %%distributed cell
    feeds its LiveDisplay), kept in a list instead of drawn: pytest has no kernel to draw in."""
    from nbtrain.engine import metrics

    payloads = []

    class Sink:
        def feed(self, payload):
            payloads.append(payload)

    monkeypatch.setattr(metrics, "_make_local_display", Sink)
    return payloads


def test_a_stopped_run_ends_stopped_not_finished(tiny, tmp_path, monkeypatch):
    """issue 34, 19: a run stopped from the Lab leaves "(stopped)" under the cell, as the cell log and
    the Lab say; its loss axis is titled as an SFT loss."""
    import nbtrain
    from nbtrain import runs
    from nbtrain.data.examples import instructions_path
    from nbtrain.recipes.hooks import Hooks

    payloads = _published(monkeypatch)
    hooks = Hooks()

    @hooks.on_step
    def stop_at_step_2(recipe, step, **kw):
        if step == 2:
            runs.request_stop(recipe.runlog.run_id)

    cfg = nbtrain.SFTConfig(
        model=tiny,
        data=instructions_path(),
        output_dir=str(tmp_path / "run"),
        max_steps=6,
        per_device_train_batch_size=2,
        max_length=48,
        logging_steps=1,
        data_cache="off",
    )
    result = nbtrain.finetune(cfg, hooks=hooks)
    assert result.state == "stopped"
    assert payloads[-1] == {"kind": "end", "state": "stopped"}
    live = LiveDisplay(min_interval=1e9)
    for payload in payloads:
        live.feed(payload)
    final = live.bundle(final=True)
    assert "(stopped)" in final["text/plain"] and "(finished)" not in final["text/plain"]
    assert "<b>run</b> (stopped)" in final["text/html"]
    assert live._axes[0].get_ylabel() == "nats/token"


def test_a_dpo_run_titles_its_loss_per_pair(tiny, tmp_path, monkeypatch):
    """issue 34, 20: DPO's loss is a mean over pairs, not nats/token: the run announces its kind and
    the final plot titles the loss axis with DPO's unit; a run that ends normally says finished."""
    import nbtrain
    from nbtrain.data.examples import preferences_path

    payloads = _published(monkeypatch)
    cfg = nbtrain.DPOConfig(
        model=tiny,
        data=preferences_path(),
        output_dir=str(tmp_path / "dpo"),
        max_steps=2,
        per_device_train_batch_size=4,
        logging_steps=1,
        save_steps=None,
        max_length=64,
        data_cache="off",
    )
    nbtrain.finetune(cfg)
    begin = payloads[0]
    assert (begin["kind"], begin["run_kind"], begin["loss_unit"]) == (
        "begin",
        "dpo",
        "DPO loss/pair",
    )
    live = LiveDisplay(min_interval=1e9)
    for payload in payloads:
        live.feed(payload)
    assert "(finished)" in live.bundle(final=True)["text/plain"]
    assert [ax.get_ylabel() for ax in live._axes] == ["DPO loss/pair", "tokens/s", "reward margin"]
