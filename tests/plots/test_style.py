"""nbtrain.plots.style on real matplotlib figures: the Lab's palette and colour rule, nice ticks with
the axis ending on a tick, one label format per axis, widths and the transparent background."""

from __future__ import annotations

import io
import math

import pytest

from nbtrain import plots
from nbtrain.plots import style


def test_fnv1a32_matches_the_reference_values_and_picks_the_labs_colour():
    # FNV-1a 32-bit reference values (the offset basis for "", and the published test vectors)
    assert style.fnv1a32("") == 0x811C9DC5
    assert style.fnv1a32("a") == 0xE40C292C
    assert style.fnv1a32("foobar") == 0xBF9CF968
    run_id = "0123456789ab"
    assert plots.run_colour(run_id) == plots.PALETTE_LIGHT[style.fnv1a32(run_id) % 8]
    assert (
        plots.run_colour(run_id, plots.PALETTE_DARK)
        == plots.PALETTE_DARK[style.fnv1a32(run_id) % 8]
    )
    assert len(plots.PALETTE_LIGHT) == len(plots.PALETTE_DARK) == 8


@pytest.mark.parametrize(
    ("lo", "hi", "integer"),
    [(0.9, 4.8547, False), (1, 187, True), (0.0019, 0.00197, False), (3140.0, 3260.0, False)],
)
def test_nice_ticks_cover_the_data_with_a_1_2_5_step(lo, hi, integer):
    ticks = plots.nice_ticks(lo, hi, integer=integer)
    assert ticks[0] <= lo and ticks[-1] >= hi
    steps = {round(b - a, 12) for a, b in zip(ticks, ticks[1:], strict=False)}
    assert len(steps) == 1
    step = steps.pop()
    mantissa = step / 10 ** math.floor(math.log10(step))
    assert any(abs(mantissa - m) < 1e-9 for m in (1, 2, 5)), ticks
    assert 3 <= len(ticks) <= 7
    if integer:
        assert all(float(t).is_integer() for t in ticks)


def test_a_styled_chart_ends_on_ticks_writes_one_format_and_is_transparent():
    from PIL import Image

    fig, axes = plots.new_figure(3)
    assert len(axes) == 3 and len(fig.axes) == 4 and not fig.axes[3].get_visible()
    ax = axes[0]
    xs = list(range(1, 188))
    ys = [0.00195 - 1e-5 * (i % 7) for i in xs]  # learning-rate-sized values
    ax.plot(xs, ys, color=plots.run_colour("abc"))
    plots.style_axes(ax, title="learning_rate", ylabel="learning_rate", xlabel="step")
    fig.canvas.draw()
    yticks = list(ax.get_yticks())
    assert ax.get_ylim() == (yticks[0], yticks[-1])
    assert yticks[0] <= min(ys) and yticks[-1] >= max(ys)
    labels = [t.get_text() for t in ax.get_yticklabels()]
    # e-notation with the same mantissa decimals on every tick (issue 38, 9: 1.95e-3 beside 1.9e-3)
    assert all("e-3" in lbl for lbl in labels), labels
    assert len({len(lbl.split("e")[0]) for lbl in labels}) == 1, labels
    assert all(float(x).is_integer() for x in ax.get_xticks())
    assert ax.get_lines()[0].get_color() == plots.run_colour("abc")
    png = plots.png_bytes(fig)
    img = Image.open(io.BytesIO(png))
    assert img.size == (plots.MAX_WIDTH_PX, 2 * style.CHART_HEIGHT_PX)
    assert img.mode == "RGBA" and img.getpixel((img.size[0] - 2, img.size[1] - 2))[3] == 0


def test_log_axis_ticks_at_1_2_5():
    fig, (ax,) = plots.new_figure(1)
    ax.plot([1, 2, 3], [0.5, 3.0, 40.0])
    ax.set_yscale("log")
    plots.style_axes(ax)
    fig.canvas.draw()
    ticks = [t for t in ax.get_yticks() if 0.5 <= t <= 40]
    assert set(ticks) == {0.5, 1, 2, 5, 10, 20}
    img_width = fig.get_figwidth() * fig.dpi
    assert img_width <= plots.MAX_WIDTH_PX
