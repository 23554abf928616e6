"""The tiny model builder and the shipped instruction dataset that demos and tests run on."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest


def test_tiny_model_loads_through_from_pretrained(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nbtrain.model.tiny import make_tiny_model

    t0 = time.perf_counter()
    path = make_tiny_model(tmp_path / "tiny")
    assert time.perf_counter() - t0 < 5
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert 50_000 < sum(p.numel() for p in model.parameters()) < 1_000_000
    assert tok.pad_token == "<|pad|>" and tok.eos_token == "<|im_end|>"
    assert tok.pad_token_id != tok.eos_token_id
    assert model.config.vocab_size == len(tok)
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # byte-level: any text round-trips
    text = "Ünïcødé ✓ and 123"
    assert tok.decode(tok(text)["input_ids"]) == text
    out = model.generate(
        **tok("Reverse the word: cat", return_tensors="pt"), max_new_tokens=3, do_sample=False
    )
    assert out.shape[1] > 0
    # the same seed builds the same weights
    again = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "again"))
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, msg=n)


def test_tiny_qwen2(tmp_path):
    from transformers import AutoModelForCausalLM

    from nbtrain.model.tiny import make_tiny_model

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "q", arch="qwen2"))
    assert model.config.model_type == "qwen2"
    with pytest.raises(ValueError, match="llama, qwen2"):
        make_tiny_model(tmp_path / "x", arch="gpt5")


def test_shipped_dataset_is_what_the_script_generates():
    from nbtrain.data.examples import instructions_path
    from nbtrain.data.examples.make_instructions import make_rows
    from nbtrain.data.loader import load_rows, row_format

    rows = load_rows(instructions_path())
    assert rows == json.loads(json.dumps(make_rows()))
    assert 200 <= len(rows) <= 1000
    formats = [row_format(r) for r in rows]
    assert formats.count("prompt/completion") == formats.count("messages") == len(rows) // 2


def test_public_names_import_cheaply():
    code = (
        "import sys, nbtrain; nbtrain.SFTConfig; nbtrain.TrainResult; nbtrain.finetune; "
        "print(sorted(m for m in ('torch', 'transformers', 'peft', 'pandas') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


RANK_WORKER = """
import os, sys
import torch.distributed as dist
from nbtrain.model.tiny import make_tiny_model
store = dist.FileStore(sys.argv[1], 2)
dist.init_process_group("gloo", store=store, rank=int(sys.argv[2]), world_size=2)
rank = dist.get_rank()
make_tiny_model(os.path.join(sys.argv[3], f"own-{rank}"))   # as on nodes with their own disks
make_tiny_model(os.path.join(sys.argv[3], "shared"))        # as two ranks of one host, at once
dist.barrier()
dist.destroy_process_group()
"""


def test_tiny_model_is_written_on_every_rank_of_a_process_group(tmp_path):
    # transformers' save_pretrained writes weights on global rank 0 only inside a process group; a
    # rank of another node would then have no model to fine-tune
    from transformers import AutoModelForCausalLM

    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_WORKER, str(tmp_path / "store"), str(r), str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out
    for name in ("own-0", "own-1", "shared"):
        assert (tmp_path / name / "model.safetensors").is_file(), sorted(
            x.name for x in (tmp_path / name).iterdir()
        )
        AutoModelForCausalLM.from_pretrained(tmp_path / name)
    # no half-written folders left beside them
    assert sorted(x.name for x in tmp_path.iterdir()) == ["own-0", "own-1", "shared", "store"]
