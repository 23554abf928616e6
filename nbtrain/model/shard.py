"""FSDP2 sharding for `finetune(shard="fsdp" | "hsdp")`: the frozen base and the LoRA weights split across
ranks, one `fully_shard` unit per transformer block and one for the root.

How the model gets onto the ranks without any rank holding all of it: every rank builds the model with
its parameters on the meta device (no memory), wraps LoRA around it, shards it, allocates only its own
shards, and then reads only its own slices of each weight straight from the safetensors files
(`safe_open(...).get_slice`): rows start:stop of each tensor, never the whole. No broadcast is needed,
so loading costs no network traffic, at the price of every rank reading its part of the files (local or
shared storage; every rank calls `from_pretrained` under DDP too). Memory per rank while loading: its
shard of the weights plus one slice in flight (see `nbtrain.model.memory`).

QLoRA (`load_in_4bit`) follows the same steps with bitsandbytes' 4-bit layers in the meta model
(`quant.skeleton`); a 4-bit weight's block scales need all of it, so each one is read whole, one at a
time, quantised on the rank's device (`quant.quantize_like`), and only this rank's rows of its packed
words are kept.

The LoRA init is caught as peft makes it on the CPU (before it moves it to the meta device), seeded as
DDP seeds it, so a sharded run starts from the same adapter as a DDP run: LoRA on an MoE's fused experts
(peft's parameter LoRA) included, which is exact under FSDP2 (tests/model/test_shard_families.py).

The units: each decoder layer (the model's `_no_split_modules` class) is one `fully_shard` unit, whole,
with its attention, router, experts and all their LoRA inside (no expert block is a unit of its own), and
the root is one more.
"""

from __future__ import annotations

import contextlib
import json
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nbtrain.engine.dist import Dist
from nbtrain.errors import ConfigError
from nbtrain.model import quant

log = logging.getLogger(__name__)

SHARDED_DIR = "sharded"  # the dcp folder inside a checkpoint of a sharded run


# ------------------------------------------------------------------------------------- the mesh
def make_mesh(d: Dist, shard: str, group: Any) -> Any:
    """The data-parallel DeviceMesh: 1-D over the run's ranks (fsdp), or (nodes, ranks per node) (hsdp)."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    dev = d.device.type
    if not dist.is_initialized():
        # one rank with no process group (a plain notebook): FSDP2 still needs one, of one rank
        backend = "nccl" if dev == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if shard == "fsdp":
        if group is not None:
            return DeviceMesh.from_group(group, dev, mesh_dim_names=("shard",))
        return init_device_mesh(dev, (d.world,), mesh_dim_names=("shard",))
    if group is not None:
        msg = "shard='hsdp' with finetune(group=...) is not supported; use shard='fsdp' on a sub-group"
        raise ConfigError(msg)
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or (1 if d.world == 1 else 0))
    layout = d.gather_objects((d.host, local))
    if not local or d.world % local or any(lw != local for _, lw in layout):
        msg = (
            f"shard='hsdp' needs the same number of ranks on every node (LOCAL_WORLD_SIZE) dividing the "
            f"{d.world} ranks; rank {d.rank} on {d.host} sees LOCAL_WORLD_SIZE={local or 'unset'}. Start "
            "the same number of ranks per node, or use shard='fsdp'"
        )
        raise ConfigError(msg)
    # ranks are numbered node by node, so node n holds ranks n*local .. n*local+local-1
    for node in range(d.world // local):
        hosts = {h for h, _ in layout[node * local : (node + 1) * local]}
        if len(hosts) > 1:
            msg = (
                f"shard='hsdp': ranks {node * local}..{node * local + local - 1} should be one node but run "
                f"on {sorted(hosts)}; number ranks node by node, or use shard='fsdp'"
            )
            raise ConfigError(msg)
    return init_device_mesh(dev, (d.world // local, local), mesh_dim_names=("replicate", "shard"))


def check_shard(cfg: Any, d: Dist) -> str | None:
    """A ConfigError for what does not compose with a sharded run; a note for what works but is odd."""
    if cfg.shard == "ddp":
        return None
    if cfg.torch_compile:
        msg = (
            f"torch_compile=True with shard={cfg.shard!r} is not supported by nbtrain yet (compiled blocks "
            "under FSDP2 hooks are untested here); set torch_compile=False (Liger's kernels and "
            "gradient_checkpointing still apply), or shard='ddp'"
        )
        raise ConfigError(msg)
    if cfg.load_in_8bit:
        msg = (
            f"load_in_8bit with shard={cfg.shard!r} is not supported: bitsandbytes' 8-bit weights keep "
            "their scales beside the weight, where FSDP2 cannot shard them; use load_in_4bit=True (QLoRA "
            "shards under FSDP2), or load_in_8bit with shard='ddp'"
        )
        raise ConfigError(msg)
    if d.world == 1:
        return (
            f"shard={cfg.shard!r} on 1 rank: nothing to shard across, so it saves no memory over "
            "shard='ddp' (it runs the same code path, which is what it is good for: a dry run)"
        )
    return None


def check_resume(cfg: Any, state: dict[str, Any], path: str | None) -> None:
    """A ConfigError when the checkpoint was written by the other kind of run (its optimizer state is in
    another format: one file from rank 0 under DDP, shards under FSDP)."""
    saved = state.get("shard", "ddp")
    if (saved == "ddp") != (cfg.shard == "ddp"):
        msg = (
            f"checkpoint {path} was written with shard={saved!r} and this run has shard={cfg.shard!r}; "
            f"resume with shard={saved!r}, or start a new run from its adapter"
        )
        raise ConfigError(msg)


# ------------------------------------------------------------------------------------- building
@contextlib.contextmanager
def _params_on_meta() -> Iterator[None]:
    """Parameters made on the meta device (no memory), buffers (rotary tables) left real and small."""
    import torch

    register = torch.nn.Module.register_parameter

    def on_meta(module: Any, name: str, param: Any) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            kind = type(module._parameters[name])
            module._parameters[name] = kind(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def _apply_lora(base: Any, cfg: Any, apply_lora: Any) -> tuple[Any, dict[str, Any]]:
    """(`apply_lora(base, cfg)` seeded as DDP seeds it, the LoRA weights peft made on the way: name ->
    tensor). peft draws each layer's A and B on the CPU (nn.Linear, then its own reset) and only then
    moves them to the base's meta device, so they are caught in between, rounded to the dtype they are
    moved in as DDP's are: DDP's adapter, in peft's own order (the linear layers first, then the
    parameter LoRAs of fused experts as peft creates them, the nested one last)."""
    import torch

    torch.manual_seed(cfg.seed)
    with _catching_lora_init() as caught:
        model = apply_lora(base, cfg)
    full = {}
    for name, layer in model.named_modules():
        for key, value in caught.get(id(layer), (None, {}))[1].items():
            full[f"{name}.{key}"] = value
    return model, full


@contextlib.contextmanager
def _catching_lora_init() -> Iterator[dict[int, tuple[Any, dict[str, Any]]]]:
    """id(layer) -> (layer, {"lora_A.<adapter>.weight": its initial value, ...}) for each LoRA layer
    peft builds inside the block (held by reference, so no id is reused)."""
    from peft.tuners.lora import LoraLayer, ParamWrapper
    from peft.tuners.tuners_utils import BaseTunerLayer

    caught: dict[int, tuple[Any, dict[str, Any]]] = {}
    # the two definitions peft's LoRA layers use: a module LoRA's (BaseTunerLayer) and ParamWrapper's own
    originals = {
        cls: cls.__dict__["_move_adapter_to_device_of_base_layer"]
        for cls in (BaseTunerLayer, ParamWrapper)
    }

    def catching(orig: Any) -> Any:
        def move(self: Any, adapter_name: str, *args: Any, **kwargs: Any) -> None:
            before = {}
            if isinstance(self, LoraLayer):
                for part in ("lora_A", "lora_B"):
                    mods = getattr(self, part)
                    if adapter_name in mods and mods[adapter_name].weight.device.type != "meta":
                        before[part] = mods[adapter_name].weight.detach().clone()
            orig(self, adapter_name, *args, **kwargs)
            seen = caught.setdefault(id(self), (self, {}))[1]
            for part, value in before.items():
                dtype = getattr(self, part)[adapter_name].weight.dtype
                seen.setdefault(f"{part}.{adapter_name}.weight", value.to(dtype).float())

        return move

    for cls, orig in originals.items():
        cls._move_adapter_to_device_of_base_layer = catching(orig)  # type: ignore[method-assign]
    try:
        yield caught
    finally:
        for cls, orig in originals.items():
            cls._move_adapter_to_device_of_base_layer = orig  # type: ignore[method-assign]


def _weight_files(model: str) -> list[Path]:
    """The safetensors files of `model` (a local folder, or downloaded from the Hub like from_pretrained)."""
    path = Path(model).expanduser()
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(model, allow_patterns=["*.safetensors", "*.json"]))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        msg = (
            f"shard='fsdp' loads weights from safetensors files, and {model!r} has none (a .bin-only "
            "model?); convert it with save_pretrained(safe_serialization=True), or use shard='ddp'"
        )
        raise ConfigError(msg)
    return files


def local_rows(param: Any) -> tuple[int, int] | None:
    """Rows start:stop of the full weight that this rank's shard of `param` holds (FSDP2 shards dim 0
    as torch.chunk does); None when the parameter is not sharded."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return None
    start, stop = 0, param.shape[0]
    for mesh_dim, placement in enumerate(param.placements):
        if placement.is_shard():
            if placement.dim != 0:  # type: ignore[attr-defined]
                msg = f"nbtrain's sharded loader handles dim-0 shards only, got {placement}"
                raise RuntimeError(msg)
            n = param.device_mesh.size(mesh_dim)
            r = param.device_mesh.get_local_rank(mesh_dim)
            size = stop - start
            chunk = -(-size // n)
            start, stop = min(start + r * chunk, stop), min(start + (r + 1) * chunk, stop)
    return start, stop


def _fill(param: Any, full_or_slice: Any, via: Any = None) -> None:
    """Copy this rank's rows of a full weight (a tensor or a safetensors slice) into `param`'s shard,
    rounded through dtype `via` on the way where given (as from_pretrained would load it)."""
    import torch
    from torch.distributed.tensor import DTensor

    local = param.to_local() if isinstance(param, DTensor) else param
    rows = local_rows(param)
    src = full_or_slice[rows[0] : rows[1]] if rows else full_or_slice[:]
    if tuple(src.shape) != tuple(local.shape):
        msg = f"sharded load: slice {tuple(src.shape)} does not match the local shard {tuple(local.shape)}"
        raise RuntimeError(msg)
    if via is not None:
        src = src.to(via)
    with torch.no_grad():
        local.copy_(src.to(local.dtype))


def _own_generation_config(base: Any, source: str) -> None:
    """The model's generation_config.json where it has one, as from_pretrained reads it (from_config
    makes one from config.json alone, which misses e.g. a chat model's extra end-of-turn tokens)."""
    from transformers import GenerationConfig

    try:
        base.generation_config = GenerationConfig.from_pretrained(source)
    except (OSError, ValueError):
        pass  # none: the one made from config.json stands


def build_sharded(
    cfg: Any, d: Dist, mesh: Any, weights_dtype: Any, compute_dtype: Any, prepare: Any
) -> Any:
    """The peft LoRA model, sharded over `mesh` with FSDP2, each rank holding only its own shards
    (`prepare(base)`: what to do to the base before LoRA, e.g. Liger's kernels)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from nbtrain.model.pretrained import apply_lora, enable_checkpointing, model_source

    source = model_source(cfg.model)
    config = AutoConfig.from_pretrained(source)
    quantized = quant.quantized(cfg)
    dtype = quant.load_dtype(compute_dtype, d.device) if quantized else weights_dtype
    with _params_on_meta():
        base = AutoModelForCausalLM.from_config(config, dtype=dtype)
    _own_generation_config(base, source)
    base.config.use_cache = False
    base.config.name_or_path = source  # peft writes it into the adapter's base_model_name_or_path
    base.name_or_path = source
    # QLoRA: bitsandbytes' 4-bit layers in the skeleton, each weight quantised as it is read (below)
    recipes = quant.skeleton(base, cfg, d.device, dtype) if quantized else {}
    # the dtype each weight is read in (peft's k-bit preparation then upcasts the non-4-bit ones to fp32)
    via = {n: p.dtype for n, p in base.named_parameters()}
    if quantized:
        base = quant.prepare_for_training(base, cfg, d.device)
    elif cfg.gradient_checkpointing:
        enable_checkpointing(base)
    prepare(base)
    model, lora = _apply_lora(base, cfg, apply_lora)

    # bf16 compute with fp32 LoRA masters and fp32 gradient reduction where the run computes in bf16;
    # plain fp32 (no casts at all) otherwise, so that a CPU run equals DDP to float32 rounding
    mp = (
        MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        if compute_dtype is not None
        else MixedPrecisionPolicy()
    )
    inner = model.get_base_model()
    blocks = set(getattr(inner, "_no_split_modules", None) or [])
    units = [m for m in inner.modules() if type(m).__name__ in blocks]
    if not units:
        msg = (
            f"shard={cfg.shard!r}: {type(inner).__name__} names no transformer block class "
            "(_no_split_modules), so nbtrain cannot shard it block by block; use shard='ddp'"
        )
        raise ConfigError(msg)
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=mp)
    fully_shard(inner, mesh=mesh, mp_policy=mp)
    # the fused loss makes lm_head the identity, so the root returns a slice of the last hidden states:
    # a view, which FSDP2 warns an in-place op could detach from its pre-backward hook. Both losses
    # (nbtrain.losses.sft, nbtrain.recipes.step) only read it out of place, as the fsdp == ddp tests show
    warnings.filterwarnings(
        "ignore",
        message=r"FSDP2-wrapped module \(FSDP\w+\) returned a view tensor",
        category=UserWarning,
    )

    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    model.to_empty(device=d.device)
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n in buffers:
                b.copy_(buffers[n])
    _load_weights(model, cfg.model, lora, via, recipes)
    return model


def _load_weights(
    model: Any, source: str, lora: dict[str, Any], via: dict[str, Any], recipes: dict[str, Any]
) -> None:
    """Fill every parameter's local shard: LoRA from its replayed init, the base from the safetensors
    files, one file at a time and only this rank's rows of each tensor. A 4-bit weight (in `recipes`)
    is read whole, one at a time, quantised on this rank's device, and only its rows of the packed
    words are kept: the whole 4-bit base is never on any rank."""
    from safetensors import safe_open

    prefix = "base_model.model."
    want: dict[str, Any] = {}
    for name, param in model.named_parameters():
        if name in lora:
            _fill(param, lora[name])
            continue
        # peft's wrappers nest (a parameter LoRA of fused experts wraps twice): drop every base_layer
        key = ".".join(p for p in name.removeprefix(prefix).split(".") if p != "base_layer")
        want[key] = param
    inner_prefix = getattr(model.get_base_model(), "base_model_prefix", "model") + "."
    paths = _weight_files(source)
    for path in paths:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                target = key if key in want else inner_prefix + key
                param = want.pop(target, None)
                if param is None:
                    continue
                if target in recipes:
                    weight = f.get_tensor(key).to(via[target]).to(param.device)
                    _fill(param, quant.quantize_like(recipes[target], weight))
                    del weight
                else:
                    _fill(param, f.get_slice(key), via.get(target))
    if want:
        from nbtrain.model import expert_files

        model_type = model.get_base_model().config.model_type
        for name, src in expert_files.fused(model_type, paths, dict(want), inner_prefix):
            _fill(want.pop(name), src, via.get(name))
    if want:
        shown = ", ".join(sorted(want)[:4])
        msg = (
            f"shard='fsdp': {len(want)} weight(s) of the model are not in {source!r}'s safetensors files "
            f"under the model's own names ({shown}...); this checkpoint needs transformers' key "
            "conversion, so load it with shard='ddp'"
        )
        raise ConfigError(msg)


def fill_adapter(model: Any, saved: dict[str, Any]) -> tuple[list[str], list[str]]:
    """A saved LoRA adapter (peft's file: names without the adapter's) into a sharded model's default
    adapter, each rank its own rows. Returns (saved weights with no place in the model, the model's
    LoRA weights the file lacks); both empty when it fits."""
    params = dict(model.named_parameters())
    lora = {n for n in params if ".lora_" in n}
    stray = []
    for key, value in saved.items():
        name = key.replace(".weight", ".default.weight") if ".lora_" in key else key
        if name not in params:
            stray.append(key)
            continue
        _fill(params[name], value)
        lora.discard(name)
    return stray, sorted(lora)


# ------------------------------------------------------------------------------------- the step
def set_gradient_sync(model: Any, sync: bool) -> None:
    """Reduce-scatter gradients only on the last micro-batch of a step (DDP's no_sync)."""
    model.get_base_model().set_requires_gradient_sync(sync)


def clip_grad_norm(params: list[Any], clip: float) -> Any:
    """The global gradient norm (a plain tensor), with gradients clipped to `clip`."""
    import torch
    from torch.distributed.tensor import DTensor

    norm = torch.nn.utils.clip_grad_norm_(params, clip)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def local_numel(model: Any, trainable: bool) -> tuple[int, int]:
    """(elements this rank holds, elements of the full model) of the frozen or the trainable weights."""
    from torch.distributed.tensor import DTensor

    held = total = 0
    for p in model.parameters():
        if p.requires_grad == trainable:
            held += (p.to_local() if isinstance(p, DTensor) else p).numel()
            total += p.numel()
    return held, total


# ------------------------------------------------------------------------------------- state
def _options(strict: bool = True) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, strict=strict)


def full_adapter(model: Any, keep: bool) -> dict[str, Any]:
    """The whole LoRA state, full tensors on the CPU where `keep` (rank 0), empty elsewhere; every rank
    must call it. Gathers the trainable weights alone, one at a time, so the peak on rank 0 is the
    adapter plus one of its tensors (get_model_state_dict would gather a tied frozen lm_head too)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            full = p.full_tensor() if isinstance(p, DTensor) else p
            if keep:
                out[name] = full.detach().cpu()
    return out


def _lora_state(model: Any, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's shards of the trainable weights and their optimizer state (a frozen weight tied to
    another, lm_head to the embeddings, slips through ignore_frozen_params: dropped here)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer, options=_options())
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in msd.items() if k in trainable}, osd


def save_sharded(path: Path, model: Any, optimizer: Any, group: Any) -> None:
    """Every rank writes its shards of the LoRA weights and the optimizer state under `path`."""
    import torch.distributed.checkpoint as dcp

    msd, osd = _lora_state(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path), process_group=group)


def load_sharded(path: Path, model: Any, optimizer: Any, group: Any) -> None:
    """Every rank reads its shards (of any world size's checkpoint: dcp reshards) into the model and optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    msd, osd = _lora_state(model, optimizer)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(path), process_group=group)
    # not strict: the frozen base is not in a checkpoint; every trainable weight must be
    missing = set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=_options(strict=False),
    ).missing_keys
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    if trainable & set(missing):
        msg = f"checkpoint {path.parent} does not hold this run's LoRA weights (another target_modules or lora_r?)"
        raise ConfigError(msg)
