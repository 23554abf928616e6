"""nbtrain's tokens and labels equal TRL's SFTTrainer's (its processed train_dataset), token for token.

TRL (1.x) turns its masks (completion_mask, assistant_masks) into a `labels` column with -100 where no loss
is taken, which is what nbtrain's Example.labels holds: the two are compared directly.

Same tokenizer, same rows: prompt/completion strings and conversations (`completion_only_loss`), and
`messages` with a template that has {% generation %} markers (`assistant_only_loss=True`).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from nbtrain.data.rows import IGNORE, encode_rows
from tests.data.test_chat import _tokenizer

pytest.importorskip("trl")


def _trl_dataset(tok, rows, tmp_path, **config):
    import datasets
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tok),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    )
    args = SFTConfig(
        output_dir=str(tmp_path / "trl"),
        report_to=[],
        max_length=None,
        packing=False,
        use_cpu=True,
        **config,
    )
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tok,
    )
    return trainer.train_dataset


def _nbtrain(tok, rows):
    examples, _ = encode_rows(rows, tok, None)
    return [(ex.input_ids, ex.labels) for ex in examples]


@pytest.fixture(scope="module")
def tiny():
    from nbtrain.model.tiny import make_tiny_tokenizer

    return make_tiny_tokenizer()


def test_prompt_completion_strings(tiny, tmp_path):
    """Both end the completion with eos and train it: TRL appends the eos text to the completion
    (then tokenizes it), nbtrain appends the eos id; the tokens are the same."""
    rows = [
        {"prompt": "Reverse the word: cat\nAnswer:", "completion": " tac"},
        {"prompt": "What is 2 plus 3?\n", "completion": "5"},
        {"prompt": "Say hi.", "completion": " hi there"},
    ]
    ds = _trl_dataset(tiny, rows, tmp_path, completion_only_loss=True)
    ours = _nbtrain(tiny, rows)
    for i, (ids, labels) in enumerate(ours):
        assert ids == ds[i]["input_ids"], i
        assert labels == ds[i]["labels"], i
        assert ids[-1] == labels[-1] == tiny.eos_token_id


def test_prompt_completion_conversations(tiny, tmp_path):
    """The completion is everything the template writes after the prompt's generation prompt: its
    text, end-of-turn and the newline after it, in both."""
    rows = [
        {
            "prompt": [{"role": "user", "content": "What is 2 plus 3?"}],
            "completion": [{"role": "assistant", "content": "5"}],
        },
        {
            "prompt": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Reverse the word cat."},
            ],
            "completion": [{"role": "assistant", "content": "tac"}],
        },
    ]
    ds = _trl_dataset(tiny, rows, tmp_path, completion_only_loss=True)
    for i, (ids, labels) in enumerate(_nbtrain(tiny, rows)):
        assert ids == ds[i]["input_ids"], i
        assert labels == ds[i]["labels"], i


CONVS = [
    [
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
    ],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome is."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You are welcome."},
    ],
]


@pytest.mark.parametrize(("family", "training"), [("qwen3", "qwen3"), ("llama3_1", "llama3")])
def test_messages_with_generation_markers(family, training, tmp_path, tmp_path_factory):
    """TRL's training templates (the real template with {% generation %} around assistant output):
    both train the marked text, and nothing else."""
    import trl

    source = Path(trl.__file__).parent / "chat_templates" / f"{training}_training.jinja"
    tok = copy.deepcopy(_tokenizer(family, tmp_path_factory))
    tok.chat_template = source.read_text(encoding="utf-8")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    rows = [{"messages": c} for c in CONVS]
    ds = _trl_dataset(tok, rows, tmp_path, assistant_only_loss=True)
    for i, (ids, labels) in enumerate(_nbtrain(tok, rows)):
        assert ids == ds[i]["input_ids"], i
        assert labels == ds[i]["labels"], i
        assert any(lab != IGNORE for lab in labels)
