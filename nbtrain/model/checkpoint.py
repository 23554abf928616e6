"""Atomic checkpoints and adapter export, written by rank 0 alone.

A folder is written under a temporary name, every file fsynced, then renamed into place, so a kill during
a save leaves the previous checkpoint (and the previous adapter) whole and loadable.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nbtrain import atomic
from nbtrain.errors import ConfigError

# CONFIG_FILE: the run's settings, in each checkpoint and in output_dir itself (what a run comparison
# reads); the names of a run folder's files are nbtrain.runs'
from nbtrain.runs import (
    ADAPTER_DIR,
    ADAPTER_WEIGHTS_FILE,
    CONFIG_FILE,
    MERGED_DIR,
    METRICS_FILE,
    MLFLOW_RUN_FILE,
    SAMPLES_FILE,
)

log = logging.getLogger(__name__)

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
STATE_FILE = "trainer_state.json"
#: what a run leaves in its output_dir besides checkpoints (mlflow_run.json: nbtrain.telemetry.tracking's
#: RUN_FILE, the MLflow run a resume continues)
RUN_LEFTOVERS = (ADAPTER_DIR, MERGED_DIR, METRICS_FILE, CONFIG_FILE, SAMPLES_FILE, MLFLOW_RUN_FILE)


def open_atomic_dir(final: Path) -> Path:
    """The empty temporary sibling that `commit_atomic_dir` renames to `final` (sweeping leftovers of
    saves killed midway); in a sharded run every rank writes into it, then rank 0 commits."""
    parent = Path(final).parent
    # a save killed midway leaves its temp folder behind; only rank 0 of one run opens these, so any
    # other temp folder is such a leftover
    for stale in parent.glob(f"{atomic.TMP_PREFIX}*"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    return atomic.open_dir(final)


def commit_atomic_dir(tmp: Path, final: Path) -> Path:
    """fsync everything in `tmp` and rename it to `final`, replacing an older `final`
    (`nbtrain.atomic.commit_dir`: the old one is set aside until the new one is in place)."""
    return atomic.commit_dir(tmp, final)


def write_atomic_dir(final: Path, fill: Callable[[Path], None], tmp: Path | None = None) -> Path:
    """Create folder `final` by filling a temporary sibling and renaming it; replaces an older `final`.
    `tmp`: a temporary folder opened already (`open_atomic_dir`), which other ranks have written into."""
    return atomic.write_dir(final, fill, open_atomic_dir(final) if tmp is None else Path(tmp))


def list_checkpoints(output_dir: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoints in `output_dir`, oldest first (a folder counts once its state file is in)."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = []
    for p in out.iterdir():
        m = CHECKPOINT_RE.match(p.name)
        if m and p.is_dir() and (p / STATE_FILE).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def any_checkpoint_dirs(output_dir: str | os.PathLike[str]) -> list[str]:
    out = Path(output_dir)
    if not out.is_dir():
        return []
    return sorted(p.name for p in out.iterdir() if CHECKPOINT_RE.match(p.name) and p.is_dir())


def save_checkpoint(
    output_dir: Path,
    step: int,
    *,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    rng_states: list[Any],
    state: dict[str, Any],
    config: dict[str, Any],
    adapter_state: dict[str, Any] | None = None,
    tmp: Path | None = None,
) -> Path:
    """Write `output_dir/checkpoint-<step>`: adapter, optimizer, scheduler, per-rank RNG, state, config.

    A sharded run passes `optimizer=None` (every rank wrote its shards into `tmp` already), the
    gathered adapter as `adapter_state`, and the temporary folder `tmp` they all wrote into.
    """
    import torch

    def fill(tmp: Path) -> None:
        model.save_pretrained(tmp, state_dict=adapter_state)
        if optimizer is not None:
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        for rank, rng in enumerate(rng_states):
            torch.save(rng, tmp / f"rng_state_{rank}.pth")
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, default=str))
        # the state file goes last: list_checkpoints only counts folders that have it
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))

    return write_atomic_dir(Path(output_dir) / f"checkpoint-{step}", fill, tmp)


def restore_schedule(scheduler: Any, optimizer: Any, saved: dict[str, Any]) -> None:
    """Load a checkpoint's scheduler state and give the next step the rate of *this* run's schedule.

    The loaded rate is the one the checkpoint's schedule gave the next step; a run made longer
    (max_steps) has another schedule from here. Every scheduler transformers' get_scheduler builds is
    a LambdaLR: rate = base rate x factor(step)."""
    scheduler.load_state_dict(saved)
    rates = [
        base * factor(scheduler.last_epoch)
        for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
    ]
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        group["lr"] = rate
    scheduler._last_lr = rates


def write_run_config(output_dir: Path, config: dict[str, Any]) -> Path:
    """Write `output_dir/sft_config.json` (rank 0, at run start), atomically: a reader sees the old
    file or the new one, never half of one."""
    return atomic.write_json(Path(output_dir) / CONFIG_FILE, config, indent=2, default=str)


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Everything `save_checkpoint` wrote, as Python objects with every tensor on the CPU (read on rank
    0, then broadcast).

    On the CPU because a pickled CUDA tensor unpickles onto the same device index: broadcast as is, a
    GPU run's optimizer state would land on every rank's GPU 0, and a CPU-only machine could not read it
    at all. `optimizer.load_state_dict` moves the state to the device of each rank's parameters.
    """
    import torch
    from safetensors.torch import load_file

    p = Path(path)
    rng = []
    for f in sorted(p.glob("rng_state_*.pth"), key=lambda f: int(f.stem.rsplit("_", 1)[1])):
        # our own file holding Python/numpy RNG states, which weights_only cannot read
        rng.append(torch.load(f, weights_only=False, map_location="cpu"))
    config_file = p / CONFIG_FILE
    return {
        "adapter": load_file(str(p / ADAPTER_WEIGHTS_FILE), device="cpu"),
        # None in a sharded run's checkpoint: its optimizer state is in sharded/ (nbtrain.model.shard)
        "optimizer": torch.load(p / "optimizer.pt", weights_only=False, map_location="cpu")
        if (p / "optimizer.pt").is_file()
        else None,
        "scheduler": torch.load(p / "scheduler.pt", weights_only=False, map_location="cpu"),
        "rng": rng,
        "state": json.loads((p / STATE_FILE).read_text()),
        # the settings the checkpoint was written with: a resume compares the run's length with them
        "config": json.loads(config_file.read_text()) if config_file.is_file() else {},
    }


def prune_checkpoints(output_dir: str | os.PathLike[str], keep: int, written: Path) -> list[Path]:
    """Delete the oldest complete checkpoints so that `keep` remain, never `written` (the one just
    saved); returns the deleted folders.

    Each goes by a rename to a `.tmp-` name first, so a kill midway leaves it whole or gone (never a
    half-deleted folder that still looks complete), and the next save sweeps the leftover.
    """
    found = list_checkpoints(output_dir)
    others = [p for p in found if p.resolve() != Path(written).resolve()]
    doomed = others[: max(0, len(found) - keep)]
    for path in doomed:
        atomic.remove_tree(path)
    return doomed


def get_rng_state() -> dict[str, Any]:
    import random

    import numpy as np
    import torch

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def export_adapter(
    output_dir: Path, model: Any, tokenizer: Any, state_dict: dict[str, Any] | None = None
) -> Path:
    """Write the PEFT adapter (and tokenizer) to `output_dir/adapter`, atomically (`state_dict`: the
    adapter gathered from a sharded model's ranks)."""

    def fill(tmp: Path) -> None:
        model.save_pretrained(tmp, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)

    return write_atomic_dir(Path(output_dir) / ADAPTER_DIR, fill)


def export_merged(
    output_dir: Path, model: Any, tokenizer: Any, use_cache: bool | None = None
) -> Path:
    """Merge LoRA into the base weights and write a plain transformers model to `output_dir/merged`.

    `use_cache` is the base model's own setting, written back into the saved config: training turns
    the KV cache off, and a merged model saved that way would generate without it (slowly).
    """
    from nbtrain.model.pretrained import quiet_hf

    merged = model.merge_and_unload()

    def fill(tmp: Path) -> None:
        if use_cache is None:
            merged.save_pretrained(tmp)
        else:
            training_value = merged.config.use_cache
            merged.config.use_cache = use_cache
            try:
                merged.save_pretrained(tmp)
            finally:
                merged.config.use_cache = training_value
        tokenizer.save_pretrained(tmp)

    with quiet_hf():  # no "Writing model shards" bar under the run's own output
        return write_atomic_dir(Path(output_dir) / MERGED_DIR, fill)


def export_merged_from_adapter(
    output_dir: Path, base: str, adapter_dir: str, tokenizer: Any, dtype: Any, use_cache: Any
) -> Path:
    """Merge the exported adapter into a fresh copy of the base loaded on this process's CPU in `dtype`.

    For runs whose base cannot take the merge in place: a 4-bit base (merging would round the merged
    weights to 4 bits) or a sharded one (no rank holds it whole). Holds the whole base in CPU memory.
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from nbtrain.model.pretrained import quiet_hf

    with quiet_hf():
        full = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
        tuned = PeftModel.from_pretrained(full, adapter_dir)
    return export_merged(output_dir, tuned, tokenizer, use_cache)


def export_run(
    output_dir: Path,
    model: Any,
    tokenizer: Any,
    adapter_state: dict[str, Any] | None,
    merge: bool,
    fresh_base: str | None,
    dtype: Any,
    use_cache: Any,
) -> tuple[str, str | None]:
    """Rank 0 at the end of a run: the adapter, and with `merge` the merged model (into a fresh copy of
    `fresh_base` in `dtype`, fp32 when None, where the trained base cannot take the merge in place)."""
    import torch

    adapter_dir = str(export_adapter(output_dir, model, tokenizer, adapter_state))
    if not merge:
        return adapter_dir, None
    if fresh_base is not None:
        merged = export_merged_from_adapter(
            output_dir, fresh_base, adapter_dir, tokenizer, dtype or torch.float32, use_cache
        )
    else:
        merged = export_merged(output_dir, model, tokenizer, use_cache=use_cache)
    return adapter_dir, str(merged)


def check_output_dir(cfg: Any) -> str | None:
    """Rank 0: the checkpoint to resume from, or a ConfigError when the folder holds another run."""
    out = Path(cfg.output_dir).expanduser()
    if out.exists() and not out.is_dir():
        msg = f"output_dir {cfg.output_dir!r} is a file; pass a folder path"
        raise ConfigError(msg)
    if cfg.resume == "latest":
        found = list_checkpoints(out)
        if not found:
            msg = (
                f"resume='latest' but output_dir {cfg.output_dir!r} holds no complete checkpoint; "
                "drop resume to start a new run, or point output_dir at the run to continue"
            )
            raise ConfigError(msg)
        return str(found[-1])
    if cfg.resume is not None:
        path = Path(cfg.resume).expanduser()
        if not (path / STATE_FILE).is_file():
            msg = (
                f"resume={cfg.resume!r} is not a complete checkpoint (no {STATE_FILE}); pass a "
                "checkpoint-<step> folder written by finetune, or resume='latest'"
            )
            raise ConfigError(msg)
        return str(path)
    if cfg.overwrite:
        return None
    existing = any_checkpoint_dirs(out)
    if existing:
        shown = ", ".join(existing[:3]) + (", ..." if len(existing) > 3 else "")
        msg = (
            f"output_dir {cfg.output_dir!r} holds another run's checkpoints ({shown}); pass "
            "resume='latest' to continue that run, overwrite=True to start over, or a new output_dir"
        )
        raise ConfigError(msg)
    left = run_files(out)
    if left:
        # a run without checkpoints (save_steps=None) has nothing to resume: only starting over is left
        msg = (
            f"output_dir {cfg.output_dir!r} holds another run ({', '.join(left)}) and no checkpoint "
            "to resume from; pass overwrite=True to start over (it deletes that run's files), or a "
            "new output_dir"
        )
        raise ConfigError(msg)
    return None


def run_files(out: Path) -> list[str]:
    """What an earlier run left in `out` besides checkpoints (the files `clear_output_dir` removes),
    and its record in the runs registry; empty when `out` holds no run."""
    from nbtrain.runs import get_run, run_id_for

    if not out.is_dir():
        return []
    left = sorted(p.name for p in out.iterdir() if p.name in RUN_LEFTOVERS)
    record = get_run(run_id_for(out))
    if record is not None:
        left.append(f"a {record.get('state', 'running')} run in the runs registry")
    return left


def clear_output_dir(out: Path) -> None:
    """overwrite=True: remove what an earlier run wrote (only nbtrain's own files)."""
    for p in out.iterdir() if out.is_dir() else []:
        if (
            CHECKPOINT_RE.match(p.name)
            or p.name in (ADAPTER_DIR, MERGED_DIR)
            or p.name.startswith(".tmp-")
        ):
            shutil.rmtree(p, ignore_errors=True)
        elif p.name in RUN_LEFTOVERS:
            p.unlink()
