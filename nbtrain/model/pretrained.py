"""The base model and tokenizer through `from_pretrained`, and LoRA on top of them via peft."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from nbtrain.errors import ConfigError

log = logging.getLogger(__name__)


def _is_local(model: str) -> bool:
    return Path(model).expanduser().exists()


# whether the Hub answered this process's probe, by endpoint: asked once, not once per file
_REACHABLE: dict[str, str | None] = {}
PROBE_TIMEOUT_S = 3.0


def _hub_endpoint() -> str:
    from huggingface_hub import constants

    return str(constants.ENDPOINT)


def _offline() -> bool:
    from huggingface_hub import constants

    flags = (os.environ.get(n, "") for n in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return bool(constants.HF_HUB_OFFLINE) or any(
        f.upper() in ("1", "ON", "YES", "TRUE") for f in flags
    )


def _probe(endpoint: str) -> str | None:
    """None when `endpoint` takes a TCP connection within PROBE_TIMEOUT_S, else why not."""
    if endpoint not in _REACHABLE:
        url = urlsplit(endpoint)
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            socket.create_connection((url.hostname or "", port), timeout=PROBE_TIMEOUT_S).close()
            _REACHABLE[endpoint] = None
        except OSError as e:
            _REACHABLE[endpoint] = (
                f"{url.hostname}:{port} cannot be reached from {socket.gethostname()} ({e})"
            )
    return _REACHABLE[endpoint]


def require_hub(model: str) -> None:
    """Fail at once where `model` is neither a folder, nor in the Hugging Face cache, nor reachable
    on the Hub (HF_HUB_OFFLINE, or one short probe): transformers would retry for about 28 s first."""
    if _is_local(model):
        return
    from huggingface_hub import try_to_load_from_cache

    try:
        if isinstance(try_to_load_from_cache(model, "config.json"), str):
            return  # cached: transformers falls back to the cache
    except Exception:  # not a valid repo id: from_pretrained's own error says so
        return
    why = "HF_HUB_OFFLINE is set" if _offline() else _probe(_hub_endpoint())
    if why:
        msg = (
            f"model {model!r} is not a local folder and not in the Hugging Face cache, and the Hub "
            f"cannot be asked: {why}. Pass the folder of a model saved with save_pretrained, or "
            "download it where the Hub can be reached (hf download ORG/NAME) first"
        )
        raise ConfigError(msg)


def _load_error(model: str, what: str, err: Exception) -> ConfigError:
    if _is_local(model):
        msg = (
            f"could not load the {what} from folder {model!r}: {err}. Check that it holds config.json, the "
            "weights and the tokenizer files, as written by save_pretrained"
        )
    else:
        msg = (
            f"could not load the {what} of {model!r}: it is not a local folder and the Hub did not "
            f"answer ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}). Check the "
            "name, or download the model and pass its folder"
        )
    return ConfigError(msg)


def check_causal_lm(model: str) -> Any:
    """The model's config, or a ConfigError when `model` is missing or not a causal LM."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    path = Path(model).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        msg = f"model folder {model!r} has no config.json, so it is not a saved model; pass the folder save_pretrained wrote"
        raise ConfigError(msg)
    require_hub(model)
    try:
        config = AutoConfig.from_pretrained(str(path) if path.exists() else model)
    except Exception as e:
        raise _load_error(model, "config", e) from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        archs = ", ".join(getattr(config, "architectures", None) or []) or config.model_type
        msg = (
            f"model {model!r} is a {archs} ({config.model_type}), not a causal language model, so it cannot "
            "be fine-tuned with SFT; pick a model that AutoModelForCausalLM loads (e.g. Llama, Qwen2, GPT-2)"
        )
        raise ConfigError(msg)
    return config


def load_tokenizer(model: str) -> Any:
    """The model's tokenizer, with a pad token (the eos token when the model has none)."""
    from transformers import AutoTokenizer

    source = str(Path(model).expanduser()) if _is_local(model) else model
    require_hub(model)
    try:
        tok = AutoTokenizer.from_pretrained(source)
    except Exception as e:
        raise _load_error(model, "tokenizer", e) from None
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            msg = f"the tokenizer of {model!r} has neither a pad nor an eos token; set tokenizer.pad_token and save it"
            raise ConfigError(msg)
        tok.pad_token = tok.eos_token
    return tok


def model_source(model: str) -> str:
    """What to pass to from_pretrained: a local folder by its absolute path (peft writes this name into
    the adapter's base_model_name_or_path, and a relative one breaks once the adapter moves), else the id."""
    return str(Path(model).expanduser().resolve()) if _is_local(model) else model


def enable_checkpointing(base: Any) -> None:
    """Recompute each block's activations in backward (non-reentrant: works with frozen inputs, so
    peft needs no input-grad hook, and composes with FSDP2)."""
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.x renamed it
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


@contextlib.contextmanager
def quiet_hf() -> Iterator[None]:
    """No "Loading weights" bar and no deprecation notice of transformers' own while nbtrain loads a
    model or puts LoRA on it: under %%distributed every rank would print them, on every call."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            # transformers 5 warns from inside peft's wrapping (get_peft_model, PeftModel.from_pretrained)
            # about its own renamed attribute: nothing a user of nbtrain can change
            warnings.filterwarnings(
                "ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning
            )
            yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def load_model(
    model: str, dtype: Any, device: Any, gradient_checkpointing: bool = False, **load_kwargs: Any
) -> Any:
    """The base causal LM, frozen, on `device`, with weights in `dtype` (`load_kwargs`: e.g. a
    quantization_config, which places the model itself)."""
    from transformers import AutoModelForCausalLM

    try:
        with quiet_hf():
            base = AutoModelForCausalLM.from_pretrained(
                model_source(model), dtype=dtype, **load_kwargs
            )
    except Exception as e:
        raise _load_error(model, "model", e) from None
    base.config.use_cache = False
    if gradient_checkpointing:
        enable_checkpointing(base)
    return base if load_kwargs.get("quantization_config") else base.to(device)


def linear_module_names(model: Any) -> list[str]:
    """The distinct short names of the model's linear layers (q_proj, down_proj, lm_head...)."""
    import torch

    names = {
        n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
    }
    try:
        from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers

        names |= {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, Conv1D)}
    except ImportError:
        pass
    return sorted(names)


def check_target_modules(model: Any, target_modules: str | list[str]) -> None:
    """A ConfigError listing the model's linear modules when a target matches no module of the model."""
    if isinstance(target_modules, str) and target_modules.lower() == "all-linear":
        return
    names = [n for n, _ in model.named_modules() if n]
    if isinstance(target_modules, str):  # peft reads a string as a regex over full module names
        missing = [] if any(re.fullmatch(target_modules, n) for n in names) else [target_modules]
    else:
        missing = [
            t for t in target_modules if not any(n == t or n.endswith("." + t) for n in names)
        ]
    if missing:
        linear = ", ".join(linear_module_names(model))
        msg = (
            f"target_modules {missing} not found in model {type(model).__name__}; its linear modules are: "
            f"{linear}. Pass some of those, or target_modules='all-linear'"
        )
        raise ConfigError(msg)


def apply_lora(model: Any, cfg: Any) -> Any:
    """Wrap `model` in a peft LoRA model per `cfg` (rank, alpha, dropout, target modules, and on an
    MoE model `lora_moe`: see `nbtrain.model.targets`)."""
    from peft import LoraConfig, get_peft_model

    from nbtrain.model import targets

    check_target_modules(model, cfg.target_modules)
    t = targets.plan(model, cfg.target_modules, getattr(cfg, "lora_moe", targets.DEFAULT_MOE))
    dropout = float(cfg.lora_dropout)
    # peft's parameter LoRA (the fused experts) takes no dropout: build without, add it where peft can
    late = dropout if t.parameters and dropout else 0.0
    lora = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=0.0 if late else dropout,
        target_modules=t.modules,
        target_parameters=t.parameters or None,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        with quiet_hf():
            wrapped = get_peft_model(model, lora)
    except ValueError as e:  # e.g. a target that is not a layer type LoRA supports
        msg = (
            f"LoRA could not wrap target_modules={cfg.target_modules!r}: {e}. The model's "
            f"{targets.module_names(model)}"
        )
        raise ConfigError(msg) from None
    if late:
        n = targets.add_dropout(wrapped, late)
        log.info(
            "lora_dropout=%g on the %d linear LoRA layers; peft's LoRA on the %d expert parameters "
            "takes no dropout (the saved adapter_config.json says 0)",
            late,
            n,
            len(t.parameters),
        )
    if t.moe:
        log.info("LoRA on an MoE model:\n%s", t.describe())
    return wrapped
