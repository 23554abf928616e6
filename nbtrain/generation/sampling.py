"""Samples while training: completions of `SFTConfig.sample_prompts` at the run's first step, every
`sample_steps`, and at its last step, generated across the ranks (`nbtrain.generation.decode`).

In [1]: cfg = nbtrain.SFTConfig(..., sample_prompts="prompts.jsonl", sample_steps=100)

The sampler is two hooks on the recipe (`on_begin`, `on_step`), not a branch in the loop. Rank 0 appends
the rows to `output_dir/samples.jsonl` (`nbtrain.runs.SAMPLES_FILE`: {"step", "index", "prompt",
"completion", "reference", "tokens", "seconds"}), publishes them to the live display, and hands them to
report_to's TensorBoard. Sampling does not change training: the model generates in eval mode (no
dropout drawn), greedily, inside a forked RNG, and goes back to train mode with its `use_cache` as it
was; its time is left out of tokens/s and step time and logged as `sample_seconds`.

With `sample_engine="vllm"` a vLLM engine beside each rank generates them (`nbtrain.generation.engines`):
it starts at the first sample (or is the one `nbtrain.generate(engine="vllm")` left running on the
same base), after the versions are checked on every rank, and takes the adapter's current weights in
memory before each sample; on a GPU it sleeps between samples. It is kept for the next call.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from nbtrain import atomic
from nbtrain.data.prompts import read_prompts, shown
from nbtrain.engine import metrics as live
from nbtrain.generation import decode, engines
from nbtrain.runs import SAMPLES_FILE

log = logging.getLogger(__name__)


class Sampler:
    """The samples of one run: `attach(hooks)` puts it in the loop."""

    def __init__(self, cfg: Any) -> None:
        self.source = cfg.sample_prompts
        self.every: int | None = cfg.sample_steps
        self.decoding = decode.Decoding(max_new_tokens=cfg.sample_max_new_tokens)
        self.prompts: list[decode.Prompt] = []
        self.last = -1
        self.engine_name: str = getattr(cfg, "sample_engine", "hf")
        self.engine: engines.Engine | None = None
        self.lora = engines.LoraSpec(r=cfg.lora_r, alpha=cfg.lora_alpha)

    def attach(self, hooks: Any) -> None:
        hooks.add("on_begin", self.on_begin)
        hooks.add("on_step", self.on_step)

    def on_begin(self, recipe: Any, step: int) -> None:
        d = recipe.d
        self.prompts = d.agree(
            lambda: decode.encode(
                read_prompts(self.source, "sample_prompts"),
                recipe.tokenizer,
                recipe.template_kwargs,
            )
        )
        if self.engine_name == "vllm":
            # one rank that cannot start vLLM stops every rank, with its reason
            from nbtrain.generation import vllm_engine

            self.engine = d.agree(
                lambda: vllm_engine.kept(
                    recipe.cfg.model, recipe.tokenizer, d.device, self.lora, d.rank, d.host
                )
            )
        if d.is_zero:
            # a resumed run redoes the steps after its checkpoint: their samples go, as metrics' rows do
            _keep_before(Path(recipe.out) / SAMPLES_FILE, step)
        self.sample(recipe, step)

    def on_step(self, recipe: Any, step: int, **_: Any) -> None:
        if (self.every is not None and step % self.every == 0) or step == recipe.total_steps:
            self.sample(recipe, step)

    def sample(self, recipe: Any, step: int) -> None:
        """Every prompt's completion at `step`, on every rank together; rank 0 records them."""
        if step == self.last:
            return
        self.last = step
        d, model = recipe.d, recipe.peft_model
        t0 = time.perf_counter()
        try:
            with decode.generation_mode(model):
                if self.engine is not None:
                    self.engine.set_adapter(model)  # this step's LoRA weights, in memory
                rows = decode.generate_across(
                    model,
                    recipe.tokenizer,
                    self.prompts,
                    d,
                    self.decoding,
                    synced=recipe.sharded and d.world > 1 and self.engine is None,
                    autocast=recipe.autocast,
                    engine=self.engine,
                )
        finally:
            if self.engine is not None:
                self.engine.sleep()
        took = time.perf_counter() - t0
        recipe.meter.exclude(took)
        # the logged row is the same on every rank: rank 0's time
        recipe.meter.note("sample_seconds", d.broadcast_object(took))
        if rows is None:
            return
        table = [{**r, "prompt": shown(r["prompt"])} for r in rows]
        with (Path(recipe.out) / SAMPLES_FILE).open("a") as f:
            for r in table:
                f.write(json.dumps({"step": step, **r}) + "\n")
        live.samples(step, table)
        if recipe.runlog is not None and recipe.runlog.trackers is not None:
            recipe.runlog.trackers.samples(step, table)


def _keep_before(path: Path, step: int) -> None:
    """samples.jsonl with only the rows of steps before `step` (none for a new run)."""
    kept = []
    if step > 0 and path.is_file():
        for line in path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) < step:
                    kept.append(line + "\n")
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
    atomic.write_text(path, "".join(kept))
