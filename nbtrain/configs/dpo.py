"""`DPOConfig`: the settings of a LoRA DPO run, SFTConfig's where they apply and TRL's DPO names for the rest.

In [1]: cfg = nbtrain.DPOConfig(model="tiny-llama", data="prefs.jsonl", output_dir="runs/dpo",
   ...:                         beta=0.1, max_steps=100, per_device_train_batch_size=4)
In [2]: nbtrain.finetune(cfg)

The data is in TRL's preference formats (prompt/chosen/rejected, or chosen/rejected with the prompt
implicit); `nbtrain.data.prefs` reads and tokenizes it. What TRL calls `truncation_mode` is SFTConfig's
`truncation_side`: "right" is TRL's "keep_start" (its default), "left" is "keep_end".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from nbtrain.configs.sft import SFTConfig, known_keywords_only

log = logging.getLogger(__name__)

#: the DPO losses nbtrain computes, by TRL's names
LOSS_TYPES = ("sigmoid", "ipo")


@dataclass
class DPOConfig(SFTConfig):
    """Settings of one LoRA DPO run; `nbtrain.finetune(cfg)` runs it on every rank.

    The reference model is the base with the LoRA adapter off (no second copy of the model).
    """

    beta: float = field(
        default=0.1,
        metadata={
            "help": "How far the policy may move from the reference: higher keeps it closer (IPO's tau for loss_type='ipo')."
        },
    )
    loss_type: str = field(
        default="sigmoid",
        metadata={
            "help": "'sigmoid' (the DPO paper's loss, TRL's default) or 'ipo' (IPO, per-token averaged as TRL does)."
        },
    )
    precompute_ref_log_probs: bool = field(
        default=False,
        metadata={
            "help": "Compute the reference log-probabilities of every pair once before training, instead of a no-adapter forward each step."
        },
    )
    max_prompt_length: int | None = field(
        default=None,
        metadata={
            "help": "Keep at most this many prompt tokens (its end), before max_length applies; None: no separate limit (TRL 1.x)."
        },
    )
    max_completion_length: int | None = field(
        default=None,
        metadata={
            "help": "Keep at most this many tokens of each completion (its start), before max_length applies; None: no separate limit."
        },
    )
    disable_dropout: bool = field(
        default=True,
        metadata={
            "help": "Turn every dropout off (LoRA's included), as TRL's DPO does by default: the policy and the reference see the same network."
        },
    )

    def _own_problems(self) -> list[str]:
        problems: list[str] = []

        def need(ok: bool, msg: str) -> None:
            if not ok:
                problems.append(msg)

        if isinstance(self.loss_type, list | tuple) and len(self.loss_type) == 1:
            self.loss_type = self.loss_type[0]  # TRL's list form, one loss
        need(
            self.loss_type in LOSS_TYPES,
            f"loss_type={self.loss_type!r} is not supported; use one of {', '.join(LOSS_TYPES)} "
            "(TRL's other DPO losses, and weighted mixes of several, are not implemented)",
        )
        need(
            isinstance(self.beta, int | float)
            and not isinstance(self.beta, bool)
            and self.beta > 0,
            f"beta={self.beta!r} must be a number > 0, e.g. 0.1",
        )
        for name in ("precompute_ref_log_probs", "disable_dropout"):
            need(
                isinstance(getattr(self, name), bool),
                f"{name}={getattr(self, name)!r} must be True or False",
            )
        for name in ("max_prompt_length", "max_completion_length"):
            value = getattr(self, name)
            need(
                value is None
                or (isinstance(value, int) and not isinstance(value, bool) and value >= 1),
                f"{name}={value!r} must be None or an integer >= 1",
            )
        # SFT settings that have no meaning for pairs, refused rather than ignored
        need(
            not self.packing and not self.padding_free,
            "packing and padding_free are not supported for DPO: each pair's chosen and rejected "
            "sequences are scored whole; set packing=False and padding_free=False",
        )
        need(
            self.per_device_train_batch_size != "auto",
            "per_device_train_batch_size='auto' is not supported for DPO yet; give a number of "
            "pairs per rank (each pair is two sequences)",
        )
        return problems


DPOConfig.__init__ = known_keywords_only(DPOConfig.__init__)  # type: ignore[method-assign]

__all__ = ["LOSS_TYPES", "DPOConfig"]
