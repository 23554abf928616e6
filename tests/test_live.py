"""The live display's charts: the Lab's overview of the run's kind (SFT loss; DPO reward margin and
accuracy; GRPO rewards, completion length, KL), in the Lab's colours, ticks and number format, no
wider than the output area, on a transparent background; the samples table's "(empty)" and cut
characters."""

from __future__ import annotations

import io
import re
from pathlib import Path

from nbtrain import plots
from nbtrain.live import LiveDisplay


def _fed(rows, kind=None):
    live = LiveDisplay(min_interval=1e9)
    live.feed({"kind": "begin", "total_steps": 4, "name": "run", "run_kind": kind})
    for row in rows:
        live.feed({"kind": "row", "row": row})
    return live


def _image(png):
    from PIL import Image

    return Image.open(io.BytesIO(png))


def _one_nice_step(ticks):
    """Whether `ticks` are evenly spaced by 1, 2 or 5 x 10^n."""
    import math

    steps = {round(b - a, 12) for a, b in zip(ticks, ticks[1:], strict=False)}
    if len(steps) != 1:
        return False
    step = steps.pop()
    mantissa = step / 10 ** math.floor(math.log10(step))
    return any(math.isclose(mantissa, m) for m in (1, 2, 5))


def test_sft_rows_draw_loss_and_throughput():
    live = _fed([{"step": s, "loss": 1.0 / s, "tokens_per_s": 100.0} for s in (1, 2, 3)], "sft")
    svg = live._svg()
    assert "width='860'" in svg and "height='200'" in svg and "rewards" not in svg
    assert [c.title for c in live._plots()] == ["loss", "tokens_per_s"]


def test_dpo_rows_chart_the_reward_margin_and_accuracy_within_the_output_area():
    rows = [
        {
            "step": s,
            "loss": 0.69 - 0.01 * s,
            "eval_loss": 0.7 if s == 3 else None,
            "tokens_per_s": 100.0,
            "rewards/margins": 0.1 * s,
            "rewards/accuracies": 0.5 + 0.1 * s,
            "grad_norm": 1.0,
        }
        for s in (1, 2, 3)
    ]
    live = _fed(rows, "dpo")
    assert [c.title for c in live._plots()] == [
        "loss",
        "rewards/margins",
        "rewards/accuracies",
        "tokens_per_s",
    ]
    svg = live._svg()
    # two charts to a row: 860 px wide, two rows
    assert "width='860'" in svg and "height='400'" in svg
    assert svg.count("<polyline") == 5  # loss and eval loss on one chart
    png = live._png()
    img = _image(png)
    # the DPO plot was 1320 px wide, shown scaled down to 7 px text: now never over 880 px, so
    # the 9 pt tick labels stay 12.5 px on screen
    assert img.size[0] <= plots.MAX_WIDTH_PX and len(live._axes) == 4
    assert min(t.get_fontsize() for t in live._axes[0].get_yticklabels()) >= 9
    # transparent: the corner pixel (outside every axis) has no paint
    assert img.mode == "RGBA" and img.getpixel((0, 0))[3] == 0
    # DPO's loss has no unit; one run's series take the palette in order
    loss_ax = live._axes[0]
    assert loss_ax.get_ylabel() == "loss"
    colours = [line.get_color() for line in loss_ax.get_lines()]
    assert colours == [plots.PALETTE_LIGHT[0], plots.PALETTE_LIGHT[1]]
    assert f"stroke='{plots.PALETTE_LIGHT[0]}'" in svg


def test_grpo_rows_chart_each_reward_function_completion_length_and_kl():
    rows = [
        {
            "step": s,
            "loss": 0.0,
            "tokens_per_s": 100.0,
            "reward": 0.1 * s,
            "rewards/fmt/mean": 0.2 * s,
            "completions/mean_length": 30.0 + s,
            "kl": 0.01 * s,
            "gen_s": 0.1,
        }
        for s in (1, 2, 3)
    ]
    live = _fed(rows, "grpo")
    assert [c.title for c in live._plots()] == [
        "rewards/fmt/mean",
        "reward",
        "completions/mean_length",
        "kl",
        "loss",
        "tokens_per_s",
    ]
    assert live._png() is not None
    assert [ax.get_ylabel() for ax in live._axes[2:5]] == ["tokens", "kl", "loss"]
    # issue 34, 13: the progress line shows the mean reward, not only a loss near 0; in the Lab's
    # number format (0.300, not 0.3 or 0.3000)
    _, _, line = live._progress()
    assert "loss 0 · reward 0.300 · 100 tok/s" in line


def test_final_plot_and_table_read_like_the_lab_panel():
    # issue 38, 8: ticks of 1/2/5 x 10^n with the axis ending on a tick, one format per axis, the
    # table in the Lab's format: 4.85 (not 4.8547), a date for the time (not 1.79575e+09)
    live = LiveDisplay()
    live.feed({"kind": "begin", "total_steps": 3, "name": "run", "run_kind": "sft"})
    for step, lr, loss in ((1, 1.5e-05, 4.8547), (2, 2e-4, 4.7), (3, 1.25e-4, 4.61)):
        row = {"step": step, "loss": loss, "tokens_per_s": 12_345.0 + step, "learning_rate": lr}
        live.feed({"kind": "row", "row": {**row, "time": 1_795_750_000.0 + step}})
    assert live._png() is not None
    loss_ax, tps_ax = live._axes
    assert (loss_ax.get_xlabel(), loss_ax.get_ylabel()) == ("step", "nats/token")
    assert tps_ax.get_ylabel() == "tokens/s"
    yticks = list(loss_ax.get_yticks())
    assert _one_nice_step(yticks), yticks
    # no data above the last labelled tick, nor below the first
    assert yticks[0] <= 4.61 and yticks[-1] >= 4.8547
    assert loss_ax.get_ylim() == (yticks[0], yticks[-1])
    labels = [t.get_text() for t in loss_ax.get_yticklabels()]
    assert len({len(lbl.split(".")[-1]) for lbl in labels}) == 1, labels  # one format
    xticks = loss_ax.get_xticks()
    assert all(float(x).is_integer() for x in xticks)
    tps_labels = [t.get_text() for t in tps_ax.get_yticklabels()]
    assert all(lbl.endswith("k") for lbl in tps_labels if lbl != "0"), tps_labels
    table = live._table_html()
    assert ">4.61<" in table and ">12.3k<" in table and ">1.25e-4<" in table
    assert ">3<" in table and "e+09" not in table
    assert f">{plots.format_time(1_795_750_003.0)}<" in table
    _, _, line = live._progress()
    assert line.startswith("step 3/3 · loss 4.61 · 12.3k tok/s")


def test_a_caller_without_a_kind_titles_its_own_loss():
    # the Tinker service's display announces no recipe kind, and a summed loss
    live = LiveDisplay(min_interval=1e9)
    live.feed({"kind": "begin", "name": "tinker m", "loss_unit": "summed loss"})
    live.feed({"kind": "row", "row": {"step": 1, "loss": 12.0, "tokens_per_s": 10.0}})
    assert live._png() is not None and live._axes[0].get_ylabel() == "summed loss"


def test_samples_show_empty_completions_and_drop_a_cut_character():
    live = LiveDisplay(min_interval=1e9)
    live.feed({"kind": "begin", "total_steps": 4, "name": "run"})
    rows = [
        {"index": 0, "prompt": "a", "completion": "   "},
        {"index": 1, "prompt": "b", "completion": "caf\u00e9 \ufffd"},  # cut inside a character
    ]
    live.feed({"kind": "samples", "step": 2, "rows": rows})
    page = live._samples_html()
    assert "(empty)" in page and "\ufffd" not in page and "café " in page
    text = live._samples_text()
    assert "[0] 'a' -> (empty)" in text and "\ufffd" not in text


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


def test_a_dpo_run_titles_its_loss_without_a_unit(tiny, tmp_path, monkeypatch):
    """issue 34, 20 and 38, 1: DPO's loss is not nats/token and has no unit: the run announces its
    kind and the final plot titles the loss axis "loss", with the reward margin and accuracy beside
    it, as the Lab draws them; a run that ends normally says finished."""
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
        "loss",
    )
    live = LiveDisplay(min_interval=1e9)
    for payload in payloads:
        live.feed(payload)
    assert "(finished)" in live.bundle(final=True)["text/plain"]
    assert [ax.get_ylabel() for ax in live._axes] == [
        "loss",
        "rewards/margins",
        "rewards/accuracies",
        "tokens/s",
    ]


LAB = Path(__file__).resolve().parents[1] / "labextension"


def _ts_palette(name):
    """A palette array as labextension/src/metrics.ts declares it (the Lab's own colours)."""
    src = (LAB / "src" / "metrics.ts").read_text()
    body = re.search(rf"export const {name} = \[(.*?)\];", src, re.S)
    assert body is not None, f"metrics.ts declares no {name}"
    return tuple(re.findall(r"'(#[0-9a-fA-F]{6})'", body.group(1)))


def test_the_loss_is_drawn_in_the_runs_colour_of_the_lab():
    # the Lab's vitest pins what its run panel draws for this run (tests/metrics.test.ts, SHARED_RUN)
    vitest = (LAB / "tests" / "metrics.test.ts").read_text()
    pinned = re.search(r"SHARED_RUN = \{ id: '(\w+)', lines: \['(#\w+)', '(#\w+)'\] \}", vitest)
    assert pinned is not None, "metrics.test.ts pins no SHARED_RUN"
    run_id, lab_loss, lab_next = pinned.groups()
    assert _ts_palette("PALETTE_LIGHT") == plots.PALETTE_LIGHT
    assert _ts_palette("PALETTE_DARK") == plots.PALETTE_DARK
    # the run's colour is not the palette's first: the notebook used to start every run there
    assert plots.run_colour(run_id) == lab_loss != plots.PALETTE_LIGHT[0]
    rows = [
        {"step": s, "loss": 0.69 - 0.01 * s, "eval_loss": 0.7 if s == 3 else None}
        for s in (1, 2, 3)
    ]
    live = LiveDisplay(min_interval=1e9)
    live.feed(
        {"kind": "begin", "total_steps": 4, "name": "run", "run_kind": "dpo", "run_id": run_id}
    )
    for row in rows:
        live.feed({"kind": "row", "row": row})
    svg = live._svg()
    live._png()
    loss_ax = live._axes[0]
    lines = {line.get_label(): line.get_color() for line in loss_ax.get_lines()}
    assert lines == {"loss": lab_loss, "eval_loss": lab_next}
    assert f"stroke='{lab_loss}'" in svg and f"stroke='{lab_next}'" in svg
    assert f"stroke='{plots.PALETTE_LIGHT[1]}'" not in svg  # not the palette in order
    # a new run in the same display takes its own colour
    other = "5e1f0c2a9d3b"
    live.feed({"kind": "begin", "run_kind": "dpo", "run_id": other})
    live.feed({"kind": "row", "row": rows[0]})
    assert f"stroke='{plots.run_colour(other)}'" in live._svg()
    assert plots.run_colour(other) != lab_loss
