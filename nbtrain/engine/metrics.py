"""`nbtrain.log()`: one row of training metrics, streamed live to the notebook.

On a cluster engine, rank 0 publishes each row on ipyparallel's data channel; the `%%distributed` cell
that is running picks it up and draws the live loss and throughput plots. In a plain process inside a
notebook kernel, the rows drive the same live display directly. Other ranks' calls are ignored, so a
user's own loop may call `log` on every rank.

Wire format (the client's `nbtrain.live.MetricsFeed` reads it): published keys are
``"nbtrain.metrics.<seq>"`` with a zero-padded sequence number, each value a dict with ``kind`` one of
``"begin"`` (``total_steps``, ``name``), ``"row"`` (``row``: the metrics dict), ``"samples"``
(``step``, ``rows``: the completions sampled at that step, each {"index", "prompt", "completion",
"reference", "tokens", "seconds"} with the prompt as one string; `SFTConfig.sample_prompts`) or ``"end"``.

In a plain kernel the rows go to a sink the kernel side registered (`set_local_sink`: `import nbtrain`
registers the live display), so this module, which runs on engines, never imports widget code.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable
from typing import Any

from nbtrain.engine.rank import is_rank_zero

logger = logging.getLogger(__name__)

KEY_PREFIX = "nbtrain.metrics."

_lock = threading.Lock()
_seq = 0
_local_display: Any = None
#: makes the object a plain kernel's rows are fed to (`feed(payload)`); registered by the kernel side
_local_sink: Callable[[], Any] | None = None


def set_local_sink(factory: Callable[[], Any] | None) -> None:
    """Register what draws rows in a plain kernel: `factory()` returns an object with `feed(payload)`
    (payloads as in the wire format above), made at each run's `begin`. None: rows are not drawn."""
    global _local_sink
    _local_sink = factory


def _on_engine() -> bool:
    return os.environ.get("NBTRAIN_ENGINE") == "1"


def _publish(payload: dict[str, Any]) -> None:
    global _seq, _local_display
    if not is_rank_zero():
        return
    with _lock:
        _seq += 1
        seq = _seq
    if _on_engine():
        from ipyparallel.datapub import publish_data

        publish_data({f"{KEY_PREFIX}{seq:08d}": payload})
        return
    # a plain process: draw in this kernel if there is one, else stay silent (the caller prints).
    # A row with no `begin` before it (a user's own loop, no cluster) opens the display itself.
    if payload["kind"] == "begin" or (payload["kind"] == "row" and _local_display is None):
        _local_display = _make_local_display()
    if _local_display is not None:
        _local_display.feed(payload)
        if payload["kind"] == "end":
            _local_display = None


def _make_local_display() -> Any:
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    ip = get_ipython()
    if ip is None or getattr(ip, "kernel", None) is None or _local_sink is None:
        return None
    return _local_sink()


def _clean(value: Any) -> Any:
    # numbers only travel as plain Python floats/ints, so the client never needs torch to unpickle
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def begin(
    total_steps: int | None = None,
    name: str | None = None,
    kind: str | None = None,
    loss_unit: str | None = None,
    run_id: str | None = None,
) -> None:
    """Announce a run: the live display sizes its progress bar from `total_steps`, titles the loss
    axis `loss_unit` (a recipe's: `nbtrain.runs.loss_unit(kind)`; "nats/token" when not given) and
    draws the loss in the colour of `run_id` (`nbtrain.runs.run_id_for`), as the Lab does."""
    _publish(
        {
            "kind": "begin",
            "total_steps": total_steps,
            "name": name,
            "run_kind": kind,
            "loss_unit": loss_unit,
            "run_id": run_id,
        }
    )


def log(step: int | None = None, **metrics: Any) -> None:
    """Record one row of metrics (rank 0 only) for the notebook's live plots.

    In [1]: %%distributed
       ...: for step in range(100):
       ...:     loss = train_step()
       ...:     nbtrain.log(step=step, loss=loss, tokens_per_s=tps)

    ``loss`` and ``tokens_per_s`` get a chart each, and ``eval_loss`` is drawn on the loss chart;
    every other key (``learning_rate`` too) is kept for the table of the last row that stays under the
    cell when it ends. Values may be numbers or 0-d tensors; NaN is kept as a gap.

    On a cluster, rows go to the `%%distributed` cell that is running. In a notebook with no cluster,
    the first row opens the live display in this kernel; `nbtrain.log_end()` leaves the final image and
    table (a `%%distributed` cell does that by itself when it ends).
    """
    row: dict[str, Any] = {}
    if step is not None:
        row["step"] = int(step)
    for key, value in metrics.items():
        row[key] = _clean(value)
    _publish({"kind": "row", "row": row})


def samples(step: int, rows: list[dict[str, Any]]) -> None:
    """The completions sampled at `step` (rank 0 only), for the table under the live plots."""
    clean = [{k: _clean(v) for k, v in r.items()} for r in rows]
    _publish({"kind": "samples", "step": int(step), "rows": clean})


def end(state: str | None = None) -> None:
    """Close the live display for this run: it leaves a static image and the final metrics table,
    titled with how the run ended (`state`: done, stopped, preempted or failed; "finished" when not
    given)."""
    _publish({"kind": "end", "state": state})


def log_end() -> None:
    """End a run of `log` rows outside a `%%distributed` cell: the live display becomes its final image
    and metrics table (an own loop in a plain notebook; on a cluster the cell does this itself)."""
    end()
