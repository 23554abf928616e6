"""The losses Tinker's `forward_backward(data, loss_fn)` names, per datum, summed over its tokens.

In [1]: from nbtrain.losses.tinker import datum_loss
In [2]: total, per_token = datum_loss("ppo", lp, {"logprobs": q, "advantages": a}, None)

`lp` is the learner's log-probability of each `target_tokens` entry; `q` the sampler's (the datum's
`loss_fn_inputs["logprobs"]`), `A` the advantages, `r = exp(lp - q)`. Every loss is a SUM over tokens
(and, by the caller, over datums), never a mean: Tinker's definition, so a client that splits a batch
into chunks gets the same gradient as one call.

| name | per-token loss |
|---|---|
| cross_entropy | -lp * weights |
| importance_sampling | -r * A |
| ppo | -min(r * A, clip(r, lo, hi) * A)   (lo, hi: `clip_low_threshold` 0.8, `clip_high_threshold` 1.2) |
| cispo | -stopgrad(clip(r, lo, hi)) * lp * A |
| dro | -(lp * A - beta/2 * (lp - q)^2)   (`beta`: required, Tinker publishes no default) |
"""

from __future__ import annotations

import logging
from typing import Any

from nbtrain.errors import ConfigError

log = logging.getLogger(__name__)

#: the losses this module computes, and the `loss_fn_inputs` each reads
SUPPORTED: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("weights",),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
    "dro": ("logprobs", "advantages"),
}
#: named by Tinker, with no public formula: refused rather than guessed
REFUSED = ("gspo", "stable_reinforce")
#: `loss_fn_config` keys each loss reads, with their defaults (None: required)
DEFAULTS: dict[str, dict[str, float | None]] = {
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "dro": {"beta": None},
}


def check(loss_fn: str, config: dict[str, Any] | None = None) -> dict[str, float]:
    """The loss's settings (defaults filled in), or a ConfigError naming the supported losses."""
    if loss_fn not in SUPPORTED:
        why = (
            "Tinker names it but publishes no formula, so nbtrain does not guess one"
            if loss_fn in REFUSED
            else "it is not one of Tinker's built-in losses"
        )
        msg = (
            f"loss_fn {loss_fn!r} is not supported ({why}); use one of {', '.join(SUPPORTED)}, or "
            "forward_backward_custom for a loss computed in the client"
        )
        raise ConfigError(msg)
    settings = dict(DEFAULTS.get(loss_fn, {}))
    unknown = sorted(set(config or {}) - set(settings))
    if unknown:
        allowed = ", ".join(settings) or "none"
        msg = f"loss_fn_config keys {unknown} do not apply to {loss_fn!r} (it reads: {allowed})"
        raise ConfigError(msg)
    for key, value in (config or {}).items():
        settings[key] = float(value)
    missing = [k for k, v in settings.items() if v is None]
    if missing:
        msg = f"loss_fn {loss_fn!r} needs loss_fn_config {{{', '.join(repr(k) + ': ...' for k in missing)}}}"
        raise ConfigError(msg)
    return {k: float(v) for k, v in settings.items() if v is not None}


def datum_loss(
    loss_fn: str, lp: Any, inputs: dict[str, Any], config: dict[str, Any] | None = None
) -> tuple[Any, Any]:
    """(the datum's summed loss, its per-token loss) for the learner's log-probs `lp` (1-D, the
    datum's length) and its `loss_fn_inputs` as tensors of the same length."""
    import torch

    settings = check(loss_fn, config)
    missing = [k for k in SUPPORTED[loss_fn] if k not in inputs]
    if missing:
        msg = (
            f"loss_fn {loss_fn!r} needs loss_fn_inputs {list(SUPPORTED[loss_fn])} on every datum; "
            f"missing: {missing}"
        )
        raise ConfigError(msg)

    def get(name: str) -> Any:
        return inputs[name].to(device=lp.device, dtype=lp.dtype)

    if loss_fn == "cross_entropy":
        per_token = -lp * get("weights")
    else:
        q, adv = get("logprobs"), get("advantages")
        if loss_fn == "dro":
            per_token = -(lp * adv - 0.5 * settings["beta"] * (lp - q) ** 2)
        else:
            ratio = torch.exp(lp - q)
            if loss_fn == "importance_sampling":
                per_token = -ratio * adv
            else:
                lo, hi = settings["clip_low_threshold"], settings["clip_high_threshold"]
                clipped = torch.clamp(ratio, lo, hi)
                if loss_fn == "ppo":
                    per_token = -torch.minimum(ratio * adv, clipped * adv)
                else:  # cispo
                    per_token = -clipped.detach() * lp * adv
    return per_token.sum(), per_token
