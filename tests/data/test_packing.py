"""Packing and padding-free batches: documents stay apart, and the loss is the loss of each row alone.

Every number is computed on a tiny Llama loaded through from_pretrained, in fp32, with the loss function
the training loop uses (`nbtrain.recipes.step.token_loss_sum`), for both attention implementations that build masks
(SDPA and eager).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from nbtrain.data.loader import IGNORE, ShardedBatches, collate, encode_row, pack
from nbtrain.recipes.step import token_loss_sum

ATTN = ["sdpa", "eager"]
DOC = {"text": "the cat sat on the mat and looked at the sun"}
ROWS = [
    {"prompt": "Reverse the word: cat\nAnswer: ", "completion": "tac"},
    {"text": "the sun is yellow and the sky is blue today"},
    {"prompt": "What is 2 plus 3?\n", "completion": "5"},
    {
        "messages": [
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Green, like grass."},
        ]
    },
]

# one BLAS thread: the test machine is small and shared (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tok(tiny):
    from nbtrain.model.pretrained import load_tokenizer

    return load_tokenizer(tiny)


@pytest.fixture(scope="module", params=ATTN)
def model(request, tiny):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(
        tiny, dtype=torch.float32, attn_implementation=request.param
    )
    assert m.config._attn_implementation == request.param
    return m.eval()


def _loss_sum(model, batch):
    return token_loss_sum(model, batch, contextlib.nullcontext)


def _batches(rows, tok, **kw):
    base = dict(batch_size=1, grad_accum=1, seed=0, rank=0, world_size=1)
    base.update(kw)
    return ShardedBatches(rows, tok, **base)


# ------------------------------------------------------------------------------ the block's structure
def test_packed_block_positions_restart_and_doc_starts_are_not_targets(tok):
    exs = [encode_row(r, tok, None) for r in ROWS]
    lens = [len(e.input_ids) for e in exs]
    total = sum(lens)
    (block,) = pack(exs, total)
    want_pos = [p for n in lens for p in range(n)]
    assert block.position_ids == want_pos
    starts = [sum(lens[:i]) for i in range(len(lens))]
    for s, ex in zip(starts, exs, strict=True):
        assert block.labels[s] == IGNORE  # never predicted from the previous document
        assert block.labels[s + 1 : s + len(ex.labels)] == ex.labels[1:]
    assert block.n_targets == sum(e.n_targets for e in exs)
    # the collated tensors carry the positions, and no attention mask (transformers' packed path)
    batch = collate([block], total, tok.pad_token_id, "packed")
    assert "attention_mask" not in batch
    assert batch["position_ids"][0].tolist() == want_pos
    assert batch["labels"][0, starts].eq(IGNORE).all()


def test_long_document_wraps_into_the_next_block(tok):
    long = {"text": " ".join(f"word{i}" for i in range(40))}
    full = encode_row(long, tok, None)
    L = 16
    assert len(full.input_ids) > 2 * L  # it spans three blocks
    sb = _batches([long, ROWS[1], ROWS[2], ROWS[0]], tok, packing=True, max_length=L, seed=1)
    # the rows in packing order, each whole, one after the other
    order = sb.shard(0)
    stream = [t for i in order for t in encode_row(sb.rows[i], tok, None).input_ids]
    blocks = sb._packed(0)
    assert [t for b in blocks for t in b.input_ids] == stream  # nothing is left out
    assert all(len(b.input_ids) == L for b in blocks[:-1]) and len(blocks[-1].input_ids) <= L
    # every block starts a sequence: the carried-over piece of a document gets positions 0, 1, ...
    for b in blocks:
        assert b.position_ids[0] == 0 and b.labels[0] == IGNORE
    start = sum(len(encode_row(sb.rows[i], tok, None).input_ids) for i in order[: order.index(0)])
    k, off = divmod(start, L)
    # the long document is not cut at max_length: all its tokens are in the blocks, in order
    pieces = []
    j, at = k, off
    while len(pieces) < len(full.input_ids) and j < len(blocks):
        pieces += blocks[j].input_ids[at:]
        j, at = j + 1, 0
    assert pieces[: len(full.input_ids)] == full.input_ids
    # inside the block after the first, its piece starts over at position 0
    nxt = blocks[k + 1]
    assert nxt.position_ids[: L - 1] == list(range(L - 1))


# ------------------------------------------------------------------------------- losses on the model
def test_block_of_four_copies_has_the_loss_of_the_document_alone(tok, model):
    doc = encode_row(DOC, tok, None)
    n = len(doc.input_ids)
    sb = _batches([DOC] * 4, tok, packing=True, max_length=4 * n)
    (block,) = sb.micro_batch(0, 0)
    assert block.input_ids == doc.input_ids * 4
    with torch.no_grad():
        alone = _loss_sum(model, collate([doc], n, tok.pad_token_id))
        packed = _loss_sum(model, sb.collate([block], 4 * n))
    assert block.n_targets == 4 * doc.n_targets
    torch.testing.assert_close(packed / block.n_targets, alone / doc.n_targets)
    # two such blocks in one micro-batch: each row keeps its own block-diagonal mask
    sb2 = _batches([DOC] * 8, tok, packing=True, max_length=4 * n, batch_size=2)
    with torch.no_grad():
        two = _loss_sum(model, sb2.collate(sb2.micro_batch(0, 0), 4 * n))
    torch.testing.assert_close(two, 8 * alone)


def test_wrapped_piece_is_a_new_sequence(tok, model):
    # a document cut by the block boundary: its piece in the next block has the loss of that piece alone
    long = {"text": " ".join(f"word{i}" for i in range(30))}
    full = encode_row(long, tok, None)
    doc = encode_row(DOC, tok, None)
    L = len(full.input_ids) - 5
    blocks = pack([full] + [doc] * 8, L)
    k = 1
    assert blocks[k].input_ids[:5] == full.input_ids[L:]
    piece = full.input_ids[L:]
    with torch.no_grad():
        got = model(
            input_ids=torch.tensor([blocks[k].input_ids]),
            position_ids=torch.tensor([blocks[k].position_ids]),
        ).logits[0, :5]
        want = model(input_ids=torch.tensor([piece])).logits[0]
    torch.testing.assert_close(got, want)


def test_padding_free_equals_padded(tok, model):
    rows = ROWS * 2 + [{"text": f"row {i} says hello to the sun"} for i in range(8)]
    padded = _batches(rows, tok, max_length=64, batch_size=8)
    flat = _batches(rows, tok, max_length=64, batch_size=8, padding_free=True)
    exs = padded.micro_batch(0, 0)
    assert exs == flat.micro_batch(0, 0)
    # a text row (its first token has a label) that is not first in the row: that label must not count
    assert any(e.labels[0] != IGNORE for e in exs[1:])
    longest = max(len(e.input_ids) for e in exs)
    pb, fb = padded.collate(exs, longest), flat.collate(exs, longest)
    assert fb["input_ids"].shape == (1, sum(len(e.input_ids) for e in exs))
    assert "attention_mask" not in fb and not fb["input_ids"].eq(tok.pad_token_id).any()
    assert int(fb["labels"][:, 1:].ne(IGNORE).sum()) == sum(e.n_targets for e in exs)

    def loss_and_grads(batch):
        model.zero_grad(set_to_none=True)
        loss = _loss_sum(model, batch)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads

    lp, gp = loss_and_grads(pb)
    lf, gf = loss_and_grads(fb)
    torch.testing.assert_close(lf, lp)
    assert gp.keys() == gf.keys() and len(gp) > 0
    torch.testing.assert_close(gf, gp, rtol=1e-4, atol=1e-6)


def test_finetune_padding_free_trains_like_padded(tiny, tmp_path):
    from pathlib import Path

    from safetensors.torch import load_file

    from nbtrain.configs.sft import SFTConfig
    from nbtrain.recipes.train import finetune

    data = str(
        Path(__file__).resolve().parents[2] / "nbtrain" / "data" / "examples" / "instructions.jsonl"
    )

    def run(name, **kw):
        cfg = SFTConfig(
            model=tiny,
            data=data,
            output_dir=str(tmp_path / name),
            max_steps=4,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            learning_rate=1e-2,
            max_length=48,
            logging_steps=1,
            save_steps=None,
            lora_r=8,
            lora_dropout=0.0,
            dtype="float32",
            **kw,
        )
        result = finetune(cfg)
        return result, load_file(str(Path(result.adapter_dir) / "adapter_model.safetensors"))

    padded, a_padded = run("padded")
    flat, a_flat = run("flat", padding_free=True)
    torch.testing.assert_close(
        torch.tensor(flat.history["loss"].tolist()), torch.tensor(padded.history["loss"].tolist())
    )
    # Adam divides by the gradient's size: float32 rounding shows in the smallest entries
    torch.testing.assert_close(a_flat, a_padded, rtol=1e-3, atol=1e-5)
