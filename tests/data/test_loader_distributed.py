"""The data path on two real ranks (gloo): the epoch's last, partial step, packing, and bad rows.

Each test compares two ranks with one rank taking twice the batch, as test_sft_distributed does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from nbtrain.configs.sft import SFTConfig
from nbtrain.errors import ConfigError
from nbtrain.recipes.train import finetune
from tests.recipes.test_distributed import DATA, _adapter, _kw, _losses, run_ranks

# one BLAS thread: the test machine is small and shared (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _rows(n):
    return [json.loads(x) for x in Path(DATA).read_text().splitlines()[:n]]


def _same_run(two, one):
    h2, h1 = two[0]["history"], one.history.to_dict(orient="records")
    assert [r["step"] for r in h2] == [r["step"] for r in h1]
    torch.testing.assert_close(_losses(h2), _losses(h1))
    a2, a1 = _adapter(two[0]["adapter_dir"]), _adapter(one.adapter_dir)
    # Adam divides by sqrt(v): see test_two_ranks_equal_one_rank_with_twice_the_batch
    torch.testing.assert_close(a2, a1, atol=1e-4, rtol=1e-3)
    assert max(v.abs().max().item() for k, v in a2.items() if "lora_B" in k) > 1e-3


def test_last_partial_step_with_an_idle_rank_equals_one_rank(tiny, tmp_path):
    # 13 rows, a global batch of 8 (2 ranks x 2 rows x 2 micro-batches): step 2 takes the last 5 rows,
    # and in its second micro-batch rank 1 has none (it still joins DDP's all-reduce)
    kw = dict(data=_rows(13), max_steps=-1, num_train_epochs=2)
    two = run_ranks(tmp_path, 2, **_kw(tiny, tmp_path / "two", **kw))
    one = finetune(SFTConfig(**_kw(tiny, tmp_path / "one", per_device_train_batch_size=4, **kw)))
    assert [r["step"] for r in two[0]["history"]] == [1, 2, 3, 4]  # 2 epochs of ceil(13 / 8)
    _same_run(two, one)


def test_packing_on_two_ranks_equals_one_rank(tiny, tmp_path):
    kw = dict(packing=True, max_length=32, max_steps=3)
    two = run_ranks(tmp_path, 2, **_kw(tiny, tmp_path / "two", **kw))
    one = finetune(SFTConfig(**_kw(tiny, tmp_path / "one", per_device_train_batch_size=4, **kw)))
    _same_run(two, one)


def test_bad_row_stops_every_rank_before_any_write(tiny, tmp_path):
    from transformers import AutoTokenizer

    model = tmp_path / "strict-model"
    shutil.copytree(tiny, model)
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    tok.save_pretrained(model)
    rows = [{"prompt": f"Repeat {i}\n", "completion": f"{i}"} for i in range(60)]
    rows[41] = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"},
        ]
    }
    out = tmp_path / "out"
    with pytest.raises(AssertionError) as e:
        run_ranks(tmp_path, 2, **_kw(str(model), out, data=rows))
    assert "data row 41: the chat template could not render it" in str(e.value)
    assert "System role not supported" in str(e.value)
    assert not out.exists()
    with pytest.raises(ConfigError, match="data row 41"):
        finetune(SFTConfig(**_kw(str(model), out, data=rows)))
    assert not out.exists()
