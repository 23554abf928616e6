"""The models this process holds for the Tinker service: each base model loaded once, a LoRA adapter per
training model on it (peft's multi-adapter model), each with its own AdamW state, and the sampler
snapshots.

Every LoRA model on one base shares the base's weights; an adapter costs its own weights, their
gradients and two AdamW moments (about 4x the adapter's size in fp32). The base stays frozen. Only the
adapter being used is active (`set_adapter`), so a forward pass computes one LoRA, whichever model it
serves.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import random
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from nbtrain.engine.dist import Dist
from nbtrain.errors import ConfigError

log = logging.getLogger(__name__)

#: Tinker's LoRA has no dropout and a fixed alpha
LORA_ALPHA = 32
#: ephemeral sampler snapshots kept per process (oldest dropped first); an RL loop makes one a step.
#: They are held in CPU memory (a rank-32 LoRA of an 8B model is about 0.3 GB)
MAX_SNAPSHOTS = 16
#: the peft adapter slot that sampler snapshots and adapter folders are loaded into to sample
SAMPLER_SLOT = "sampler"


class UnknownModelError(ConfigError, LookupError):
    """A model, sampler or checkpoint id this process does not hold (the server answers 404)."""


@dataclass
class Base:
    """One base model, loaded once: the peft model over it once an adapter exists."""

    name: str
    model: Any
    tokenizer: Any
    device: Any
    dtype: Any
    adapters: set[str] = field(default_factory=set)
    #: the LoRA settings the sampler slot was made with (None: no slot yet)
    slot_lora: tuple[Any, ...] | None = None
    #: what the sampler slot holds now (a sampler id, or an adapter folder), so it is not copied again
    slot_tag: Any = None


@dataclass
class Trainee:
    """One training model: its adapter on a base, its optimizer and accumulated step count."""

    model_id: str
    base: Base
    adapter: str
    lora: dict[str, Any]
    params: list[tuple[str, Any]]
    optimizer: Any
    steps: int = 0
    #: loss:sum and target tokens accumulated since the last optim_step (for the live plot)
    pending_loss: float = 0.0
    pending_tokens: int = 0


_serials = itertools.count(1)


@dataclass
class Snapshot:
    """The weights of an adapter at one moment, for sampling: peft state-dict keys to tensors."""

    base_name: str
    lora: Any  #: the peft LoraConfig it was made with
    tensors: dict[str, Any]
    #: unique per snapshot in this process (a sampler id may be saved again with new weights)
    serial: int = field(default_factory=lambda: next(_serials))


BASES: dict[str, Base] = {}
MODELS: dict[str, Trainee] = {}
SNAPSHOTS: OrderedDict[str, Snapshot] = OrderedDict()
_counter = [0]


def dist() -> Dist:
    """The process group as the service sees it (the whole world; one process when none)."""
    return Dist()


def exchange(d: Dist, fn: Callable[[], Any]) -> list[Any]:
    """`fn()` on this rank, then every rank's value gathered to all; if it failed on any rank, every
    rank raises, naming the first that failed and its host (a rank that lost its models in a restart,
    or ran out of memory, must not leave its peers waiting in a collective)."""
    value, report = None, None
    try:
        value = fn()
    except Exception as e:  # reported to every rank below, which raise it as its kind
        kind = (
            "unknown"
            if isinstance(e, UnknownModelError)
            else "config"
            if isinstance(e, ConfigError)
            else "other"
        )
        report = (kind, f"{type(e).__name__}: {e}")
    every = d.gather_objects((value, report, d.host))
    failed = [(r, rep, host) for r, (_, rep, host) in enumerate(every) if rep is not None]
    if not failed:
        return [v for v, _, _ in every]
    r, (kind, text), host = failed[0]
    msg = f"rank {r} on {host}: {text}"
    if kind == "unknown":
        raise UnknownModelError(msg)
    if kind == "config":
        raise ConfigError(msg)
    raise RuntimeError(msg)


def choose_dtype(device: Any) -> Any:
    """bf16 weights on a GPU that computes in bf16, else fp32 (on CPU bf16 would be slow and lossy)."""
    import torch

    if device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False):
        return torch.bfloat16
    return torch.float32


def get_base(name: str, d: Dist | None = None) -> Base:
    """The base model `name` (a folder or a Hub id), loaded on this rank's device the first time."""
    from nbtrain.model.pretrained import check_causal_lm, load_model, load_tokenizer

    if name in BASES:
        return BASES[name]
    d = d or dist()
    check_causal_lm(name)
    dtype = choose_dtype(d.device)
    model = load_model(name, dtype, d.device)
    model.eval()  # no dropout anywhere: Tinker's forward passes are deterministic
    BASES[name] = Base(name, model, load_tokenizer(name), d.device, dtype)
    return BASES[name]


def check_lora(lora: dict[str, Any]) -> dict[str, Any]:
    """Tinker's LoraConfig as a plain dict with its defaults, checked."""
    out = {
        "rank": lora.get("rank", 32),
        "seed": lora.get("seed"),
        "train_attn": bool(lora.get("train_attn", True)),
        "train_mlp": bool(lora.get("train_mlp", True)),
        "train_unembed": bool(lora.get("train_unembed", True)),
    }
    rank = out["rank"]
    if not (isinstance(rank, int) and not isinstance(rank, bool) and rank >= 1):
        msg = f"lora rank={rank!r} must be an integer >= 1"
        raise ConfigError(msg)
    if not (out["train_attn"] or out["train_mlp"] or out["train_unembed"]):
        msg = "train_attn, train_mlp and train_unembed are all False: LoRA would train nothing; set one"
        raise ConfigError(msg)
    return out


def lora_config(base: Base, lora: dict[str, Any]) -> Any:
    """Tinker's LoraConfig as peft's: its train_* flags through `nbtrain.model.targets.by_role`
    (attention with linear attention and Mamba mixers; the MLP with an MoE's experts, not its router;
    the head)."""
    from peft import LoraConfig

    from nbtrain.model.targets import by_role

    t = by_role(_plain(base.model), lora["train_attn"], lora["train_mlp"], lora["train_unembed"])
    return LoraConfig(
        r=lora["rank"],
        lora_alpha=LORA_ALPHA,
        lora_dropout=0.0,
        target_modules=t.modules,
        target_parameters=t.parameters or None,
        bias="none",
        task_type="CAUSAL_LM",
    )


def _plain(model: Any) -> Any:
    """The transformers model under peft's wrappers (module names without peft's prefixes)."""
    from peft import PeftModel

    return model.get_base_model() if isinstance(model, PeftModel) else model


def add_adapter(base: Base, adapter: str, lora: dict[str, Any], seed: int | None) -> None:
    """Put a fresh LoRA adapter named `adapter` on `base` (A random from `seed`, B zero)."""
    import torch
    from peft import PeftModel, get_peft_model

    from nbtrain.model.pretrained import quiet_hf

    config = lora_config(base, lora)
    # the same initial adapter on every rank: the seed, or one drawn on rank 0 and shared
    with torch.random.fork_rng(devices=[]), quiet_hf(), warnings.catch_warnings():
        # LoRA on a tied lm_head trains the LoRA only; the tied weight stays frozen and shared
        warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*", category=UserWarning)
        torch.manual_seed(seed if seed is not None else random.SystemRandom().randrange(2**31))
        if isinstance(base.model, PeftModel):
            base.model.add_adapter(adapter, config)
        else:
            base.model = get_peft_model(base.model, config, adapter_name=adapter)
    base.model.eval()
    base.adapters.add(adapter)


def adapter_params(base: Base, adapter: str) -> list[tuple[str, Any]]:
    """(name, parameter) of one adapter, in a fixed order (the optimizer's state follows it)."""
    key = f".{adapter}."
    return [(n, p) for n, p in base.model.named_parameters() if key in n]


def create(
    model_id: str, base_model: str, lora: dict[str, Any], seed: int | None = None
) -> Trainee:
    """A new training model: a LoRA adapter on `base_model` and its AdamW (Tinker's defaults), on this
    rank alone (no collective). The adapter starts from `seed`, else `lora["seed"]`, else a random one:
    pass the same on every rank."""
    import torch

    if model_id in MODELS:
        msg = (
            f"model_id {model_id!r} exists already on this rank; unload it first or pick another id"
        )
        raise ConfigError(msg)
    lora = check_lora(lora)
    seed = lora["seed"] if seed is None else seed
    base = get_base(base_model)
    _counter[0] += 1
    adapter = f"lora{_counter[0]}"
    add_adapter(base, adapter, lora, seed)
    params = adapter_params(base, adapter)
    for _, p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(
        [p for _, p in params], lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0
    )
    trainee = Trainee(model_id, base, adapter, lora, params, optimizer)
    MODELS[model_id] = trainee
    return trainee


def get(model_id: str) -> Trainee:
    if model_id not in MODELS:
        held = ", ".join(MODELS) or "none"
        msg = f"this service holds no model {model_id!r} (models held: {held}); create or load it first"
        raise UnknownModelError(msg)
    return MODELS[model_id]


@contextlib.contextmanager
def active(trainee: Trainee) -> Iterator[Any]:
    """The peft model with `trainee`'s adapter active and trainable."""
    base = trainee.base
    base.model.set_adapter(trainee.adapter)
    for _, p in trainee.params:
        p.requires_grad_(True)
    yield base.model


def unload(model_id: str) -> None:
    """Drop a model, its adapter and optimizer; the base goes too when no adapter is left on it."""
    trainee = get(model_id)
    del MODELS[model_id]
    base = trainee.base
    base.adapters.discard(trainee.adapter)
    if not base.adapters:
        # peft cannot take its last adapter off; the base is loaded afresh when needed again
        del BASES[base.name]
        _release(base)
        return
    if base.model.active_adapter == trainee.adapter:
        base.model.set_adapter(sorted(base.adapters)[0])
    base.model.delete_adapter(trainee.adapter)


def _release(base: Base) -> None:
    """Give the memory of a dropped base back (to the GPU's free pool too, for the next model)."""
    import gc

    import torch

    base.model = None
    gc.collect()
    if base.device.type == "cuda":
        torch.cuda.empty_cache()


def nbytes(tensors: Any) -> int:
    return int(sum(t.numel() * t.element_size() for t in tensors))


def memory_bytes(trainee: Trainee) -> int:
    """The adapter's weights, gradients and optimizer state, in bytes (the shared base not counted)."""
    weights = [p for _, p in trainee.params]
    grads = [p.grad for p in weights if p.grad is not None]
    state = [v for s in trainee.optimizer.state.values() for v in s.values() if hasattr(v, "numel")]
    return nbytes(weights) + nbytes(grads) + nbytes(state)


def base_bytes(base: Base) -> int:
    return nbytes(p for n, p in base.model.named_parameters() if "lora_" not in n)


def fingerprint(tensors: dict[str, Any]) -> str:
    """A short hash of a state dict's values (tests and logs compare adapters by it)."""
    h = hashlib.sha256()
    for k in sorted(tensors):
        h.update(k.encode())
        h.update(tensors[k].detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def keep_snapshot(sampler_id: str, snap: Snapshot) -> None:
    SNAPSHOTS[sampler_id] = snap
    SNAPSHOTS.move_to_end(sampler_id)
    while len(SNAPSHOTS) > MAX_SNAPSHOTS:
        SNAPSHOTS.popitem(last=False)
