"""Saved and snapshotted weights of the Tinker service: training state (adapter + AdamW state), sampler
adapters (a peft adapter folder that `PeftModel.from_pretrained` loads) and in-memory snapshots.

A state folder holds `adapter_model.safetensors` and `adapter_config.json` (so it is a peft adapter
too), `optimizer.pt` (AdamW's state_dict) and `service.json` (base model, LoRA settings, steps). All
ranks hold the same weights, so rank 0 writes, into a temporary folder renamed into place (a folder is
the old one or the new one, never half), and tells every rank whether it worked. Rank 0 reads a
folder and broadcasts it, so the other ranks need not see the same file system.
"""

from __future__ import annotations

import json
import logging
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nbtrain import atomic
from nbtrain.errors import ConfigError
from nbtrain.runs import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE
from nbtrain.tinker.ranks import registry

log = logging.getLogger(__name__)

ADAPTER_FILE = ADAPTER_WEIGHTS_FILE
OPTIMIZER_FILE = "optimizer.pt"
META_FILE = "service.json"


def adapter_tensors(base: registry.Base, adapter: str) -> dict[str, Any]:
    """The adapter's weights under peft's saved names (no adapter name in them), detached copies."""
    from peft import get_peft_model_state_dict

    # the LoRA weights only: with train_unembed on a tied model peft would add the whole embedding
    sd = get_peft_model_state_dict(base.model, adapter_name=adapter, save_embedding_layers=False)
    return {k: v.detach().clone() for k, v in sd.items()}


def weights(model_id: str, grads: bool = False) -> dict[str, Any]:
    """`model_id`'s adapter weights (or, with `grads`, their accumulated gradients; zeros where none)
    as numpy arrays under peft's saved names: for tests and inspection."""
    import torch

    trainee = registry.get(model_id)
    key = f".{trainee.adapter}."
    out = {}
    for name, p in trainee.params:
        t = p if not grads else (p.grad if p.grad is not None else torch.zeros_like(p))
        out[name.replace(key, ".")] = t.detach().float().cpu().numpy().copy()
    return out


def _peft_config(base: registry.Base, adapter: str) -> Any:
    import copy

    from nbtrain.model.pretrained import model_source

    config = copy.deepcopy(base.model.peft_config[adapter])
    config.base_model_name_or_path = model_source(base.name)
    config.inference_mode = True
    return config


def _write_adapter(folder: Path, config: Any, tensors: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    config.save_pretrained(str(folder))
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(folder / ADAPTER_FILE)
    )


def _replace_dir(path: Path, write: Callable[[Path], None]) -> None:
    """Write a folder at `path` through `write(tmp)` and move it into place: every file fsynced, the
    old folder set aside until the new one is in (`nbtrain.atomic.write_dir`)."""
    atomic.write_dir(path, write)


def _on_rank_zero(what: str, fn: Callable[[], Any]) -> Any:
    """`fn()` on rank 0; its value (or its failure, raised on every rank) broadcast to all ranks."""
    d = registry.dist()
    result: tuple[Any, str | None, bool, str] = (None, None, False, d.host)
    if d.is_zero:
        try:
            result = (fn(), None, False, d.host)
        except registry.UnknownModelError as e:  # a missing folder stays a 404
            result = (None, str(e), True, d.host)
        except Exception as e:  # told to every rank below, so none waits on rank 0
            result = (None, f"{type(e).__name__}: {e}", False, d.host)
    value, err, unknown, host = d.broadcast_object(result)
    if err is not None:
        msg = f"{what} failed on rank 0 ({host}): {err}"
        raise registry.UnknownModelError(msg) if unknown else ConfigError(msg)
    return value


def write_state(trainee: registry.Trainee, path: str, optimizer: bool = True) -> str:
    """Write `trainee`'s adapter (and AdamW state) to the folder `path` from this rank alone, with no
    collective (every rank holds the same state): `save_state` and a preemption notice use it."""
    import torch

    base = trainee.base
    tensors = adapter_tensors(base, trainee.adapter)
    config = _peft_config(base, trainee.adapter)
    meta = {
        "format": 1,
        "model_id": trainee.model_id,
        "base_model": base.name,
        "lora": trainee.lora,
        "steps": trainee.steps,
        "optimizer": optimizer,
    }

    def write(tmp: Path) -> None:
        _write_adapter(tmp, config, tensors)
        if optimizer:
            torch.save(trainee.optimizer.state_dict(), tmp / OPTIMIZER_FILE)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1))

    _replace_dir(Path(path), write)
    return str(path)


def save_state(model_id: str, path: str, optimizer: bool = True) -> dict[str, Any]:
    """Write `model_id`'s adapter (and AdamW state when `optimizer`) to the folder `path`."""
    trainee = registry.get(model_id)
    _on_rank_zero(f"saving {model_id!r} to {path}", lambda: write_state(trainee, path, optimizer))
    return {"path": str(path), "steps": trainee.steps}


def read_adapter(folder: Path) -> tuple[Any, dict[str, Any], str]:
    """(peft config, tensors, base model name) of a peft adapter folder."""
    from peft import PeftConfig
    from safetensors.torch import load_file

    if not (folder / ADAPTER_CONFIG_FILE).is_file():
        msg = f"{folder} is not an adapter folder (no adapter_config.json); pass a folder saved for sampling or training"
        raise registry.UnknownModelError(msg)
    config = PeftConfig.from_pretrained(str(folder))
    tensors = load_file(str(folder / ADAPTER_FILE))
    return config, tensors, config.base_model_name_or_path


def _read_state(folder: Path, optimizer: bool) -> dict[str, Any]:
    import torch

    if not (folder / META_FILE).is_file():
        msg = f"{folder} holds no saved training state ({META_FILE} missing); pass a folder save_state wrote"
        raise registry.UnknownModelError(msg)
    meta = json.loads((folder / META_FILE).read_text())
    _, tensors, _ = read_adapter(folder)
    opt = None
    if optimizer:
        if not (folder / OPTIMIZER_FILE).is_file():
            msg = f"{folder} was saved without the optimizer state; load the weights only"
            raise ConfigError(msg)
        opt = torch.load(folder / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
    return {"meta": meta, "tensors": tensors, "optimizer": opt}


def load_state(
    model_id: str,
    path: str,
    optimizer: bool = True,
    base_model: str | None = None,
    lora: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load a saved state into `model_id` (created first, from the saved base and LoRA settings unless
    given, where this process does not hold it); with `optimizer`, AdamW's state and step count too,
    else a fresh AdamW."""
    import torch
    from peft import set_peft_model_state_dict

    saved = _on_rank_zero(f"reading {path}", lambda: _read_state(Path(path), optimizer))
    meta = saved["meta"]
    created = model_id not in registry.MODELS

    def local() -> int:
        if created:
            registry.create(model_id, base_model or meta["base_model"], lora or meta["lora"])
        trainee = registry.get(model_id)
        if trainee.lora["rank"] != meta["lora"]["rank"]:
            msg = (
                f"{path} holds a rank-{meta['lora']['rank']} LoRA but model {model_id!r} has rank "
                f"{trainee.lora['rank']}; load it into a new model"
            )
            raise ConfigError(msg)
        device = trainee.base.device
        tensors = {k: v.to(device) for k, v in saved["tensors"].items()}
        result = set_peft_model_state_dict(
            trainee.base.model, tensors, adapter_name=trainee.adapter
        )
        missing = [k for k in getattr(result, "missing_keys", []) if f".{trainee.adapter}." in k]
        if missing:
            msg = f"{path} does not fit model {model_id!r}: its adapter lacks {missing[:3]}"
            raise ConfigError(msg)
        params = [p for _, p in trainee.params]
        for p in params:
            p.grad = None
        trainee.optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12)
        if optimizer:
            trainee.optimizer.load_state_dict(saved["optimizer"])
            trainee.steps = int(meta.get("steps", 0))
        trainee.pending_loss, trainee.pending_tokens = 0.0, 0
        return trainee.steps

    try:
        steps = registry.exchange(registry.dist(), local)[0]
    except Exception:
        if created and model_id in registry.MODELS:  # made by this call but not loaded everywhere
            registry.unload(model_id)
        raise
    return {"model_id": model_id, "path": str(path), "steps": steps}


def load_slot(base: registry.Base, config: Any, tensors: dict[str, Any], tag: Any = None) -> None:
    """Make the sampler slot adapter of `base` hold `tensors` (a LoRA made with `config`), active;
    `tag` names them (a sampler id), so that sampling the same weights again copies nothing."""
    from peft import PeftModel, get_peft_model, set_peft_model_state_dict

    from nbtrain.model.pretrained import quiet_hf

    modules = config.target_modules
    modules = modules if isinstance(modules, str) else tuple(sorted(modules or []))
    key = (config.r, config.lora_alpha, modules, tuple(sorted(config.target_parameters or [])))
    if base.slot_lora != key:
        with quiet_hf(), warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=".*tie_word_embeddings.*", category=UserWarning
            )
            if isinstance(base.model, PeftModel):
                if base.slot_lora is not None:
                    if base.model.active_adapter == registry.SAMPLER_SLOT and base.adapters:
                        base.model.set_adapter(sorted(base.adapters)[0])
                    base.model.delete_adapter(registry.SAMPLER_SLOT)
                base.model.add_adapter(registry.SAMPLER_SLOT, config)
            else:
                base.model = get_peft_model(base.model, config, adapter_name=registry.SAMPLER_SLOT)
        base.model.eval()
        base.slot_lora, base.slot_tag = key, None
    if tag is None or base.slot_tag != tag:
        moved = {k: v.to(base.device) for k, v in tensors.items()}
        set_peft_model_state_dict(base.model, moved, adapter_name=registry.SAMPLER_SLOT)
        base.slot_tag = tag
    base.model.set_adapter(registry.SAMPLER_SLOT)


def snapshot(model_id: str, sampler_id: str) -> dict[str, Any]:
    """Keep a copy of `model_id`'s adapter as it is now, to sample from as `sampler_id`; later steps
    do not change it."""
    trainee = registry.get(model_id)
    base = trainee.base
    # in host memory: the GPU keeps room for training (a sample copies them into the sampler slot)
    tensors = {k: v.cpu() for k, v in adapter_tensors(base, trainee.adapter).items()}
    snap = registry.Snapshot(base.name, _peft_config(base, trainee.adapter), tensors)
    registry.keep_snapshot(sampler_id, snap)
    return {"sampler_id": sampler_id, "base_model": base.name, "model_id": model_id}


def save_sampler(model_id: str, path: str) -> dict[str, Any]:
    """Write `model_id`'s adapter as a peft adapter folder at `path` (PeftModel.from_pretrained loads it)."""
    trainee = registry.get(model_id)
    base = trainee.base
    tensors = adapter_tensors(base, trainee.adapter)
    config = _peft_config(base, trainee.adapter)
    _on_rank_zero(
        f"saving {model_id!r}'s sampler adapter to {path}",
        lambda: _replace_dir(Path(path), lambda tmp: _write_adapter(tmp, config, tensors)),
    )
    return {"path": str(path), "base_model": base.name}


def checkpoint_folder(folder: str, model_id: str) -> str:
    """Where `checkpoint_all` writes `model_id`'s state under `folder`."""
    return str(Path(folder) / re.sub(r"[^A-Za-z0-9._-]", "_", model_id))


def checkpoint_all(folder: str) -> list[str]:
    """Save every live model's state (adapter + optimizer) under `folder`, one sub-folder per model
    (`checkpoint_folder`), e.g. on a preemption notice; returns the folders written."""
    return [
        save_state(model_id, checkpoint_folder(folder, model_id), optimizer=True)["path"]
        for model_id in sorted(registry.MODELS)
    ]
