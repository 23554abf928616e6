"""Where LoRA goes on a model: what `target_modules='all-linear'` means on dense, MoE and hybrid models.

On a dense model 'all-linear' is every linear layer but the output head, as in peft. On an MoE model
nbtrain reads the model's own blocks (a module with an `experts` child) and chooses by the
`lora_moe` setting, which names any of:

- "experts": the routed experts. transformers 5 stores them fused, as 3-d parameters
  (`experts.gate_up_proj`, `experts.down_proj`), which peft adapts through `target_parameters`; older
  layouts (a list of expert MLPs) are plain linear layers;
- "shared_experts": the always-on experts beside them (DeepSeek-V3, Llama 4, Qwen3-Next);
- "router": the gate that picks experts for each token, and Qwen's shared-expert gate.

The default adapts the experts and the shared experts and leaves the router alone. That is what
Unsloth and torchtune do for their MoE LoRA recipes, and peft's own GPT-OSS example (attention and
expert parameters, no router): a LoRA on a router with a rank-1/size-E output moves which experts are
chosen, which the load balancing was trained against. peft's own 'all-linear' does put LoRA on the
router (`mlp.gate`) and, for GPT-OSS, on no expert at all; nbtrain passes peft an explicit plan so that
neither happens.

peft's parameter LoRA (`lora.ParamWrapper`) takes no dropout. With `lora_dropout > 0` on a model whose
experts are parameters, nbtrain builds the adapter without dropout and then puts it on the linear
layers' LoRA inputs only, and says so; the saved adapter_config.json says `lora_dropout: 0`, as a
plain peft load of that adapter needs.

In [1]: t = plan(model)                 # Targets: the modules, the expert parameters, what was left out
In [2]: t.describe()                    # one line per kind, with parameter counts
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from nbtrain.configs.lora import moe_parts
from nbtrain.errors import ConfigError

log = logging.getLogger(__name__)

#: what `lora_moe` adapts unless told otherwise: experts and shared experts, never the router
DEFAULT_MOE = ("experts", "shared_experts")
#: names transformers gives an MoE block's parts
_ROUTER_NAMES = ("gate", "router", "shared_expert_gate")
_SHARED_NAMES = ("shared_expert", "shared_experts")


@dataclass
class Targets:
    """A LoRA plan: `modules` and `parameters` go to peft's LoraConfig as they are."""

    modules: str | list[str]
    parameters: list[str] = field(default_factory=list)
    linear: list[str] = field(default_factory=list)  # full names of the linear layers adapted
    expert_params: list[str] = field(
        default_factory=list
    )  # full names of expert parameters adapted
    left_out: dict[str, list[str]] = field(
        default_factory=dict
    )  # MoE part -> full names not adapted
    moe: bool = False

    def describe(self) -> str:
        lines = [
            f"linear layers: {len(self.linear)} ({', '.join(short_names(self.linear)) or 'none'})"
        ]
        if self.moe:
            lines.append(
                f"expert parameters: {len(self.expert_params)} ({', '.join(short_names(self.expert_params)) or 'none'})"
            )
            for part, names in sorted(self.left_out.items()):
                lines.append(f"not adapted, {part}: {len(names)} ({', '.join(short_names(names))})")
        return "\n".join(lines)


def short_names(names: list[str]) -> list[str]:
    """The distinct last parts of dotted names, in order of first appearance."""
    seen: dict[str, None] = {}
    for n in names:
        seen.setdefault(n.rsplit(".", 1)[-1], None)
    return list(seen)


def check_moe(moe: Any) -> tuple[str, ...]:
    """`lora_moe` as a tuple of MOE_PARTS, or a ConfigError naming the choices."""
    parts, problem = moe_parts(() if moe is None else moe)  # None: attention only, as before
    if problem:
        raise ConfigError(problem)
    return tuple(parts)


_PEFT_PARTS = {"lora_A", "lora_B", "lora_dropout", "lora_embedding_A", "lora_embedding_B"}
_PEFT_PARTS |= {"lora_magnitude_vector", "base_layer"}


def _unwrapped(module: Any) -> Any:
    """The layer under peft's LoRA wrappers (nested for parameter LoRA), or the module itself."""
    while hasattr(module, "base_layer") and hasattr(module, "lora_A"):
        module = module.base_layer
    return module


def _named_modules(model: Any) -> Iterator[tuple[str, Any]]:
    """The model's own modules by their own names, also where peft has wrapped some (the Tinker
    service adds adapters to a base that holds others): a wrapper stands for the layer it wraps."""
    for name, module in model.named_modules():
        if not _PEFT_PARTS.isdisjoint(name.split(".")):
            continue
        yield name, _unwrapped(module)


def _head_name(model: Any) -> str | None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return None
    head = _unwrapped(head)
    return next((n for n, m in _named_modules(model) if m is head), None)


def _is_linear(module: Any) -> bool:
    import torch

    if isinstance(module, torch.nn.Linear):
        return True
    try:
        from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers
    except ImportError:
        return False
    return isinstance(module, Conv1D)


def _moe_parts(model: Any) -> dict[str, str]:
    """Full module name -> MoE part ("experts", "shared_experts", "router") for every MoE block's
    children (the block is the module with an `experts` child)."""
    parts: dict[str, str] = {}
    for name, module in _named_modules(model):
        children = dict(module.named_children())
        if "experts" not in children:
            continue
        prefix = f"{name}." if name else ""
        parts[prefix + "experts"] = "experts"
        for child in children:
            if child in _ROUTER_NAMES:
                parts[prefix + child] = "router"
            elif child in _SHARED_NAMES:
                parts[prefix + child] = "shared_experts"
    return parts


def routed_experts(model: Any) -> tuple[int, float]:
    """(the parameters of the routed experts, the share of them one token uses: top-k / experts) of
    an MoE model; (0, 1.0) for a dense one. The experts are the modules MoE blocks call `experts`:
    transformers 5's fused [E, ...] parameters, or an older list of E expert MLPs; the router's top-k
    is the config's `num_experts_per_tok` (or `moe_topk`)."""
    config = getattr(model, "config", None)
    text = getattr(config, "get_text_config", lambda: config)()
    k = getattr(text, "num_experts_per_tok", None) or getattr(text, "moe_topk", None)
    modules = dict(_named_modules(model))
    numel, n_experts = 0, 0
    for name, part in _moe_parts(model).items():
        experts = modules.get(name) if part == "experts" else None
        if experts is None:
            continue
        own = [p for n, p in experts.named_parameters() if _PEFT_PARTS.isdisjoint(n.split("."))]
        numel += sum(p.numel() for p in own)
        fused = [p for p in own if p.ndim == 3]
        n_experts = n_experts or (
            int(fused[0].shape[0]) if fused else len(list(experts.children()))
        )
    if not (numel and n_experts and k):
        return 0, 1.0
    return numel, min(1.0, int(k) / n_experts)


def lora_numel(model: Any, linear: list[str], experts: list[str], r: int) -> int:
    """What peft's LoRA of rank r adds: r*(in+out) a linear layer, r*E*(in+out) an [E, in, out]
    expert parameter (peft gives each expert its rank-r pair), r*(in+out) a 2-d weight target."""
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    n = 0
    for name in linear:
        w = modules[name].weight
        n += r * (w.shape[0] + w.shape[1])
    for name in experts:
        p = params[name]
        n += (
            r * p.shape[0] * (p.shape[1] + p.shape[2])
            if p.ndim == 3
            else r * (p.shape[0] + p.shape[1])
        )
    return n


def active_numel(model: Any, total: int | None = None) -> int:
    """The parameters one token computes with: all of a dense model's; an MoE's without the routed
    experts it is not sent to. `total`: the count to start from (default: every parameter)."""
    if total is None:
        total = sum(p.numel() for p in model.parameters())
    routed, share = routed_experts(model)
    return total - routed + round(routed * share)


def _part_of(name: str, parts: dict[str, str]) -> str | None:
    for owner, part in parts.items():
        if name == owner or name.startswith(owner + "."):
            return part
    return None


def plan(
    model: Any, target_modules: str | list[str] = "all-linear", moe: Any = DEFAULT_MOE
) -> Targets:
    """The LoRA plan for `model`: an explicit list of modules (and expert parameters) for
    'all-linear'; a list or regex given by the user is taken as it is, where the name "experts" in a
    list means the expert parameters."""
    moe = check_moe(moe)
    parts = _moe_parts(model)
    head = _head_name(model)
    linear: list[str] = []
    left: dict[str, list[str]] = {}
    experts: list[str] = []
    explicit = not (isinstance(target_modules, str) and target_modules.lower() == "all-linear")
    wanted = set(moe)
    if explicit and isinstance(target_modules, list) and "experts" in target_modules:
        wanted = {"experts"}
        target_modules = [t for t in target_modules if t != "experts"]
    elif explicit:
        wanted = set()
    for name, module in _named_modules(model):
        part = _part_of(name, parts)
        if part == "experts" and name in parts:  # the experts module itself: its 3-d parameters
            params = [
                f"{name}.{p}" for p, w in module.named_parameters(recurse=False) if w.ndim == 3
            ]
            (experts if "experts" in wanted else left.setdefault("experts", [])).extend(params)
        if part == "router" and name in parts and not _is_linear(module):
            w = getattr(module, "weight", None)
            if w is not None and getattr(w, "ndim", 0) == 2:
                (experts if "router" in wanted else left.setdefault("router", [])).append(
                    f"{name}.weight"
                )
            continue
        if not _is_linear(module) or name == head or explicit:
            continue
        if part is None or part in wanted:
            linear.append(name)
        else:
            left.setdefault(part, []).append(name)
    if explicit:
        return Targets(target_modules, list(experts), [], experts, left, bool(parts))
    if not linear and not experts:
        msg = f"'all-linear' found no linear layer in {type(model).__name__} to put LoRA on"
        raise ConfigError(msg)
    pattern, params = _peft_lists(model, linear, experts)
    return Targets(pattern, params, linear, experts, left, bool(parts))


def _peft_lists(
    model: Any, linear: list[str], experts: list[str]
) -> tuple[str | list[str], list[str]]:
    """LoraConfig's target_modules and target_parameters for these linear layers and expert
    parameters. peft reads some names, on some families, as transformers 4's expert layers and moves
    them to the fused experts: a dense or shared-expert MLP named so would lose its LoRA. Its weight
    as a parameter target keeps it, and a plain peft load builds the same adapter."""
    renamed = peft_renames(model)
    as_params = [n for n in linear if n.rsplit(".", 1)[-1] in renamed]
    modules = [n for n in linear if n not in as_params]
    params = experts + [f"{n}.weight" for n in as_params]
    return (_modules_pattern(modules, model) if modules else []), params


def peft_renames(model: Any) -> set[str]:
    """Module names that peft (>= 0.18, on transformers 5) turns into expert parameters for this
    model's family: the v4 names of fused experts and routers (gate, gate_proj, up_proj, down_proj,
    w1, w2, w3). Empty for families peft leaves alone."""
    try:
        from peft.utils import transformers_weight_conversion as conv
    except ImportError:
        return set()
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    pattern = getattr(conv, "_MODEL_TO_CONVERSION_PATTERN", {}).get(model_type)
    return set(getattr(conv, "_MOE_TARGET_MODULE_MAPPING", {}).get(pattern, {}))


def _modules_pattern(linear: list[str], model: Any) -> str | list[str]:
    """Short names where they pick exactly `linear`; otherwise a regex over full names."""
    chosen = set(linear)
    names = short_names(linear)
    others = [
        n
        for n, _ in _named_modules(model)
        if n and n not in chosen and n.rsplit(".", 1)[-1] in names
    ]
    if not others:
        return sorted(names)
    return "^(?:" + "|".join(re.escape(n) for n in linear) + ")$"


def module_names(model: Any) -> str:
    """The model's own linear modules and expert parameters, for messages (not peft's wrapper names)."""
    linear = short_names([n for n, m in _named_modules(model) if _is_linear(m)])
    params = short_names(
        [
            n
            for n, p in model.named_parameters()
            if p.ndim == 3 and _PEFT_PARTS.isdisjoint(n.split("."))
        ]
    )
    out = f"linear modules: {', '.join(linear) or 'none'}"
    if params:
        out += f"; expert parameters: {', '.join(params)}"
    return out


def add_dropout(peft_model: Any, p: float) -> int:
    """Dropout `p` on the LoRA input of every linear LoRA layer (not on parameter LoRA, which peft
    cannot give one). Returns how many layers got it."""
    import torch
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper

    n = 0
    for module in peft_model.modules():
        if isinstance(module, LoraLayer) and not isinstance(module, ParamWrapper):
            for adapter in list(module.lora_dropout.keys()):
                module.lora_dropout[adapter] = torch.nn.Dropout(p=p)
                n += 1
    return n


#: path parts that put a linear layer in the MLP (Tinker's train_mlp); the rest of a block is attention
_MLP_PARTS = ("mlp", "feed_forward", "ffn", "block_sparse_moe", "shared_mlp")


def by_role(model: Any, attn: bool, mlp: bool, unembed: bool) -> Targets:
    """The LoRA plan for Tinker's `train_attn`, `train_mlp`, `train_unembed`: attention (with linear
    attention and Mamba mixers), the MLP (on an MoE: experts and shared experts, never the router)
    and the output head, each on or off."""
    t = plan(model, "all-linear", DEFAULT_MOE if mlp else ())
    head_name = _head_name(model)

    def is_mlp(name: str) -> bool:
        return any(p in _MLP_PARTS for p in name.split("."))

    linear = [n for n in t.linear if (is_mlp(n) and mlp) or (not is_mlp(n) and attn)]
    if unembed and head_name is not None:
        linear.append(head_name)
    experts = list(t.expert_params) if mlp else []
    pattern, params = _peft_lists(model, linear, experts)
    if not pattern and not params:
        flags = [
            f
            for f, on in (("train_attn", attn), ("train_mlp", mlp), ("train_unembed", unembed))
            if on
        ]
        msg = f"{flags} find no layer to put LoRA on in {type(model).__name__}; its {module_names(model)}"
        raise ConfigError(msg)
    return Targets(pattern, params, linear, experts, t.left_out, t.moe)
