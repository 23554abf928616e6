"""nbtrain.log() in a plain kernel (nbtrain/engine/metrics.py): rows go to the sink the kernel side
registered; the engine module itself never loads the live display."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from nbtrain.engine import metrics


class _Recorder:
    def __init__(self, seen):
        self.seen = seen

    def feed(self, payload):
        self.seen.append(payload)


@pytest.fixture
def plain_kernel(monkeypatch):
    """A kernel (get_ipython() with a .kernel), no engine, rank 0."""
    import IPython

    monkeypatch.delenv("NBTRAIN_ENGINE", raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(IPython, "get_ipython", lambda: types.SimpleNamespace(kernel=object()))


def test_rows_go_to_the_registered_sink(plain_kernel, monkeypatch):
    seen: list = []
    monkeypatch.setattr(metrics, "_local_display", None)
    metrics.set_local_sink(lambda: _Recorder(seen))
    try:
        metrics.begin(total_steps=2, name="run")
        metrics.log(step=1, loss=0.5)
        metrics.end()
    finally:
        import nbtrain

        metrics.set_local_sink(nbtrain._live_display)
    assert [p["kind"] for p in seen] == ["begin", "row", "end"]
    assert seen[1]["row"] == {"step": 1, "loss": 0.5}


def test_without_a_sink_nothing_is_drawn(plain_kernel, monkeypatch, capsys):
    """set_local_sink(None) unregisters what drew before: a run's rows reach no display, and none is
    made, yet log() neither fails nor prints."""
    seen: list = []
    monkeypatch.setattr(metrics, "_local_display", None)
    metrics.set_local_sink(lambda: _Recorder(seen))
    metrics.set_local_sink(None)
    try:
        metrics.log(step=1, loss=0.5)  # a row before any begin makes a display when there is a sink
        assert metrics._local_display is None
        metrics.begin(total_steps=2, name="run")
        metrics.log(step=2, loss=0.25)
        assert metrics._local_display is None
        metrics.end()
    finally:
        import nbtrain

        metrics.set_local_sink(nbtrain._live_display)
    assert seen == [], "rows reached the sink set_local_sink(None) unregistered"
    assert capsys.readouterr() == ("", "")


def test_the_engine_module_never_imports_the_live_display_and_nbtrain_registers_it():
    code = (
        "import sys\n"
        "import nbtrain.engine.metrics as m\n"
        "assert 'nbtrain.live' not in sys.modules, 'engine.metrics imported nbtrain.live'\n"
        "import nbtrain\n"
        "assert 'nbtrain.live' not in sys.modules, 'import nbtrain loaded the live display'\n"
        "assert m._local_sink is nbtrain._live_display\n"
        "from nbtrain.live import LiveDisplay\n"
        "assert isinstance(nbtrain._live_display(), LiveDisplay)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
