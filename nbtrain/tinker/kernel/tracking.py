"""Each training client is a run: a record in the registry (kind "tinker"), `metrics.jsonl` rows
for the Lab's run panel, and the live loss plot in the notebook, one row per `optim_step` with the
`forward_backward` losses summed since the step before (Tinker's losses are sums, not means)."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

from nbtrain import atomic, runs
from nbtrain.generation.utf8 import decode_completion

log = logging.getLogger(__name__)

KIND = "tinker"
LOSS_UNIT = "summed loss"
#: completions kept per optimizer step (an RL loop samples hundreds; the panel shows a few)
SAMPLES_PER_STEP = 8


def _kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover
        return False
    ip = get_ipython()
    return ip is not None and getattr(ip, "kernel", None) is not None


class ModelRun:
    """One model's run folder, record and live plot."""

    def __init__(
        self,
        folder: Path,
        model_id: str,
        base_model: str,
        cluster_id: str | None,
        world: int,
        draw: bool = True,
    ):
        self.folder = folder
        self.model_id = model_id
        folder.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.step = 0
        self._loss = 0.0
        self._tokens = 0
        self._since: float | None = None
        self.run_id = runs.register_run(
            folder,
            name=f"tinker {model_id} ({Path(base_model).name})",
            cluster_id=cluster_id,
            world_size=world,
            kind=KIND,
        )
        self._display: Any = None
        self.draw = draw
        self.tokenizer_id = base_model
        self._tokenizer: Any = None
        self._sampled: dict[int, int] = {}

    def forward_backward(self, metrics: dict[str, Any], tokens: int) -> None:
        """Add one `forward_backward`'s summed loss and tokens to the step under way."""
        with self._lock:
            if self._since is None:
                self._since = time.time()
            self._loss += float(metrics.get("loss:sum", 0.0))
            self._tokens += tokens

    def optim_step(self, learning_rate: float, metrics: dict[str, Any]) -> dict[str, Any]:
        """Close the step: one row to metrics.jsonl, the record and the live plot."""
        with self._lock:
            self.step += 1
            elapsed = time.time() - self._since if self._since is not None else 0.0
            row: dict[str, Any] = {
                "step": self.step,
                "loss": self._loss,
                "tokens": self._tokens,
                "tokens_per_s": self._tokens / elapsed if elapsed > 0 else None,
                "learning_rate": learning_rate,
                "time": time.time(),
            }
            for key, value in metrics.items():
                if isinstance(value, (int, float)):
                    row[key.split(":")[0]] = value
            self._loss, self._tokens, self._since = 0.0, 0, None
            with (self.folder / runs.METRICS_FILE).open("a") as f:
                f.write(json.dumps(row) + "\n")
            runs.update_run(
                self.run_id, step=self.step, loss=row["loss"], tokens_per_s=row["tokens_per_s"]
            )
        self._draw({"kind": "row", "row": row})
        return row

    def resume(self, step: int) -> None:
        """The model was reloaded holding `step` optimizer steps (after a restart): the same run goes
        on from there, its next row numbered `step + 1`; a step under way is dropped."""
        with self._lock:
            self.step = step
            self._loss, self._tokens, self._since = 0.0, 0, None
            runs.update_run(self.run_id, step=step, state="running", ended=None)

    def samples(self, prompt: list[int], sequences: list[dict[str, Any]], seconds: float) -> None:
        """Completions drawn from this model's weights, shown as they come: samples.jsonl (the Lab's
        samples panel) and the live display's table; at most `SAMPLES_PER_STEP` per step."""
        with self._lock:
            step = self.step
            start = self._sampled.get(step, 0)
            room = max(0, SAMPLES_PER_STEP - start)
            if room == 0:
                return
            self._sampled[step] = start + min(room, len(sequences))
        text = self._decode
        rows = [
            {
                "step": step,
                "index": start + i,
                "prompt": text(prompt),
                "completion": self._decode(list(seq.get("tokens") or []), completion=True),
                "reference": None,
                "tokens": len(seq.get("tokens") or []),
                "seconds": seconds,
            }
            for i, seq in enumerate(sequences[:room])
        ]
        with self._lock, (self.folder / runs.SAMPLES_FILE).open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        self._draw({"kind": "samples", "step": step, "rows": rows})

    def _decode(self, tokens: list[int], completion: bool = False) -> str:
        """The text of `tokens`; a completion's without the half character a length cut leaves."""
        if self._tokenizer is None:
            try:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_id)
            except Exception:  # noqa: BLE001 - the base may live only on the ranks' machines
                self._tokenizer = False
        if self._tokenizer is False:
            return " ".join(map(str, tokens))
        if completion:
            return decode_completion(self._tokenizer, tokens, skip_special_tokens=False)
        return str(self._tokenizer.decode(tokens))

    def _draw(self, payload: dict[str, Any]) -> None:
        if not self.draw or not _kernel():
            return
        try:
            if self._display is None:
                from nbtrain.live import LiveDisplay

                self._display = LiveDisplay()
                self._display.feed(
                    {
                        "kind": "begin",
                        "name": f"tinker {self.model_id}",
                        "loss_unit": LOSS_UNIT,
                        "run_id": self.run_id,
                    }
                )
            self._display.feed(payload)
        except Exception:  # noqa: BLE001 - a plot that cannot draw must not fail the request
            self._display = None

    def finish(self, state: str = "done") -> None:
        if self._display is not None:
            self._draw({"kind": "end", "state": state})
            self._display = None
        runs.finish_run(self.run_id, state, step=self.step)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Old or new, never half (`nbtrain.atomic.write_json`)."""
    atomic.write_json(path, data, sort_keys=True)
