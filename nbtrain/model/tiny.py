"""A tiny causal LM and tokenizer built from a config, for demos and tests where nothing can be downloaded.

In [1]: from nbtrain.model.tiny import make_tiny_model
In [2]: make_tiny_model("tiny-llama")          # then SFTConfig(model="tiny-llama", ...)

The model and tokenizer are written with `save_pretrained`, so everything downstream goes through the
real `from_pretrained` path.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from nbtrain import atomic

log = logging.getLogger(__name__)

PAD, EOS, BOS, IM_START = "<|pad|>", "<|im_end|>", "<|begin|>", "<|im_start|>"
SPECIAL_TOKENS = [PAD, EOS, BOS, IM_START]

# ChatML, as Qwen uses it: each turn ends with <|im_end|>, which is also the eos token, so a model trained
# on assistant turns learns to stop
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _default_corpus() -> Iterator[str]:
    from nbtrain.data.examples import INSTRUCTIONS

    with open(INSTRUCTIONS) as f:
        for line in f:
            row = json.loads(line)
            if "messages" in row:
                for m in row["messages"]:
                    yield m["role"]
                    yield m["content"]
            else:
                yield row["prompt"] + row["completion"]


def make_tiny_tokenizer(vocab_size: int = 512, corpus: Iterable[str] | None = None) -> Any:
    """A byte-level BPE tokenizer trained in well under a second on `corpus` (default: the shipped data).

    Byte-level, so any text can be encoded; with pad, eos and bos tokens and a ChatML chat template.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus if corpus is not None else _default_corpus()), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=BOS,
        chat_template=CHAT_TEMPLATE,
        padding_side="right",
        model_max_length=2048,
    )


def make_tiny_model(
    path: str | os.PathLike[str],
    *,
    arch: str = "llama",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 128,
    vocab_size: int = 512,
    max_position_embeddings: int = 512,
    embed_std: float = 0.15,
    seed: int = 0,
    corpus: Iterable[str] | None = None,
) -> str:
    """Build a tiny causal LM (random weights) and its tokenizer, save both to `path`, return the path.

    `arch` is a family of `nbtrain.model.families` ("llama", "qwen2", "qwen3_moe", "gpt_oss",
    "qwen3_5"...). The defaults give about 110K parameters (llama) and build in about a second; LoRA
    fine-tuning on the shipped instructions with learning_rate ~1e-2 takes the loss from ~6 to ~4 in
    100 steps.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from nbtrain.model.families import family

    fam = family(arch)
    tokenizer = make_tiny_tokenizer(vocab_size, corpus)
    config = fam.build_config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_layers=num_layers,
        heads=num_heads,
        intermediate_size=intermediate_size,
        max_positions=max_position_embeddings,
        special={
            "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
        },
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        # the tied output head stays frozen under LoRA, and with the usual 0.02 init its logits could
        # never leave near-uniform; a wider embedding lets LoRA drive the loss down visibly
        torch.nn.init.normal_(model.get_input_embeddings().weight, std=embed_std)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    # Inside a process group transformers writes weights on global rank 0 only, which would leave
    # every other node of a cluster without a model: every caller here wants its own copy.
    model.should_save_on_this_rank = lambda is_main_process: True
    with _quiet_saves():
        return _save(model, tokenizer, Path(path))


@contextlib.contextmanager
def _quiet_saves() -> Iterator[None]:
    """No "Writing model shards" bar: a one-shard save of a tiny model is instant, and under
    %%distributed every rank would print one."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _save(model: Any, tokenizer: Any, out: Path) -> str:
    if out.is_dir() and any(out.iterdir()):
        # an existing folder (perhaps the user's, with other files): write into it, as before
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # a new folder is written whole beside it, then renamed: ranks of one host may call this on
    # the same path at once (the same seed gives the same model), and no reader sees half a model
    try:
        # replace=False: a twin's folder already in place is kept, and this rename fails
        with atomic.folder(out, replace=False) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    except OSError:
        if not (out / "config.json").exists():
            raise  # not a twin that landed first: a real failure
    return str(out)
