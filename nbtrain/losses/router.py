"""An MoE router's load-balancing (auxiliary) loss in SFT: on where the model's config asks for it, or
where `router_aux_loss_coef` sets it; added to the training loss as TRL's SFTTrainer adds it, and logged
as `aux_loss`.

In [1]: aux, note = RouterAux.plan(peft_model, cfg.router_aux_loss_coef)   # None on a dense model
In [2]: out = model(**inputs, **aux.kwargs); aux.seen(out)                # every training forward
In [3]: objective = ce_sum * world / n_targets + aux.coef * aux.pop() / grad_accum

The weight follows TRL (`trl.SFTTrainer.compute_loss`): the router loss is a mean per micro-batch, so
a step adds `coef` times its mean over the step's micro-batches and ranks (DDP averages the ranks'
gradients) to the token-mean cross-entropy. On one rank with one micro-batch that is exactly
transformers' own `loss` for `labels` (`loss + router_aux_loss_coef * aux_loss`). The logged `loss`
stays the cross-entropy alone, comparable with a dense run and with `eval_loss`; `aux_loss` is the
unweighted router loss, as TRL logs it.

Whether it is on: `router_aux_loss_coef=None` (the default) takes the model's config, on where it
says `output_router_logits=True` with a nonzero `router_aux_loss_coef` (transformers' `Trainer` rule;
TRL turns it on whenever the coefficient is nonzero); a number turns it on with that coefficient, 0
off. A family whose transformers model returns no router loss (DeepSeek-V3, Llama 4 in 5.24) gets a
note where its config asks, and a ConfigError where the setting asks.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from nbtrain.errors import ConfigError

log = logging.getLogger(__name__)


def _text_config(config: Any) -> Any:
    """The text part of a transformers config (a multimodal one's), or the config itself."""
    return getattr(config, "get_text_config", lambda: config)()


def _base(model: Any) -> Any:
    """The transformers model under DDP's and peft's wrappers."""
    model = getattr(model, "module", model)
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def returns_router_loss(model: Any) -> bool:
    """Whether the model's own forward takes `output_router_logits` (and so can return `aux_loss`)."""
    forward = getattr(type(_base(model)), "forward", None)
    if forward is None:
        return False
    try:
        return "output_router_logits" in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False


class RouterAux:
    """The router loss of this run's training forwards: what the forward is asked (`kwargs`), the last
    forward's loss (`seen`, `pop`) and its weight `coef`."""

    kwargs = {"output_router_logits": True}

    def __init__(self, coef: float):
        self.coef = float(coef)
        self._last: Any = None

    def seen(self, out: Any) -> None:
        """Keep the router loss of a forward's output (transformers' MoeCausalLMOutput.aux_loss)."""
        self._last = getattr(out, "aux_loss", None)

    def pop(self) -> Any:
        """The last forward's router loss (a 0-d tensor in the graph), and forget it."""
        aux, self._last = self._last, None
        if aux is None or not hasattr(aux, "detach"):
            msg = (
                "the model was asked for its router logits (output_router_logits=True) but returned "
                "no aux_loss; set router_aux_loss_coef=0 to train without the router loss"
            )
            raise ConfigError(msg)
        return aux

    @classmethod
    def plan(
        cls, model: Any, setting: float | None, kind: str = "sft"
    ) -> tuple[RouterAux | None, str | None]:
        """(the router loss to add, or None; a note for the run's log, or None) for `model` and the
        `router_aux_loss_coef` setting (None: as the model's config says). Only SFT (`kind`) adds
        it for now; a DPO or GRPO run on a model that asks gets a note. What the config alone can
        refuse, `check` refused before the model loaded (`nbtrain.recipes.run_setup.check`)."""
        aux, note = cls._plan(model, setting)
        if aux is None or kind == "sft":
            return aux, note
        return (
            None,
            f"the model's config asks for a router aux loss; {kind.upper()} trains without it",
        )

    @classmethod
    def _plan(cls, model: Any, setting: float | None) -> tuple[RouterAux | None, str | None]:
        text = _text_config(getattr(model, "config", None))
        has_flag = hasattr(text, "output_router_logits")
        if setting is None:
            asked = bool(getattr(text, "output_router_logits", False))
            coef = float(getattr(text, "router_aux_loss_coef", 0.0) or 0.0)
            if not (asked and coef):
                return None, None
            if not returns_router_loss(model):
                return None, (
                    f"the model's config asks for a router aux loss (output_router_logits, "
                    f"router_aux_loss_coef={coef:g}) but {type(_base(model)).__name__} returns none: "
                    "trained without it"
                )
            return cls(
                coef
            ), f"router aux loss on (x{coef:g}, from the model's config), logged as aux_loss"
        coef = float(setting)
        if coef == 0:
            return None, None
        if not (has_flag and returns_router_loss(model)):
            msg = (
                f"router_aux_loss_coef={setting!r}: {type(_base(model)).__name__} returns no router "
                "load-balancing loss (it is not an MoE, or transformers' model of this family computes "
                "none); leave router_aux_loss_coef=None"
            )
            raise ConfigError(msg)
        return cls(coef), f"router aux loss on (x{coef:g}), logged as aux_loss"


def check(config: Any, setting: float | None, kind: str = "sft") -> None:
    """Before the model loads: a ConfigError where `router_aux_loss_coef` asks for a router loss
    that this model's config (a transformers config) has none of, or that this recipe does not add."""
    if setting is None or float(setting) == 0:
        return
    text = _text_config(config)
    if not hasattr(text, "output_router_logits"):
        msg = (
            f"router_aux_loss_coef={setting!r}: {type(text).__name__} is not an MoE with a router "
            "load-balancing loss; leave router_aux_loss_coef=None"
        )
        raise ConfigError(msg)
    if kind != "sft":
        msg = (
            f"router_aux_loss_coef={setting!r}: {kind.upper()} does not add the router loss yet "
            "(SFT does); leave it None"
        )
        raise ConfigError(msg)
