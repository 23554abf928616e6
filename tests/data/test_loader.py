"""Data: every accepted source and row format, loss masks, and sharding across ranks."""

from __future__ import annotations

import json

import pytest

from nbtrain.data.loader import (
    IGNORE,
    ShardedBatches,
    collate,
    encode_row,
    epoch_order,
    eval_batches,
    load_rows,
    row_format,
)
from nbtrain.errors import ConfigError

ROWS = [
    {"prompt": "Reverse the word: cat\nAnswer: ", "completion": "tac"},
    {
        "messages": [
            {"role": "user", "content": "What is 2 plus 3?"},
            {"role": "assistant", "content": "5"},
        ]
    },
    {"text": "the sun is yellow"},
]


@pytest.fixture(scope="module")
def tok():
    from nbtrain.model.tiny import make_tiny_tokenizer

    return make_tiny_tokenizer()


def _targets(tok, ex):
    return tok.decode([t for t, lab in zip(ex.input_ids, ex.labels, strict=True) if lab != IGNORE])


# ------------------------------------------------------------------------------------------- sources
def test_all_sources_give_the_same_rows(tmp_path):
    import datasets
    import pandas as pd

    flat = [{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": "d"}]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in flat) + "\n")  # blank line is skipped
    arr = tmp_path / "d.json"
    arr.write_text(json.dumps(flat))
    pd.DataFrame(flat).to_parquet(tmp_path / "d.parquet")
    pd.DataFrame(flat).to_csv(tmp_path / "d.csv", index=False)
    sources = [
        jsonl,
        str(arr),
        tmp_path / "d.parquet",
        str(tmp_path / "d.csv"),
        flat,
        pd.DataFrame(flat),
        datasets.Dataset.from_list(flat),
    ]
    for src in sources:
        assert load_rows(src) == flat, src


def test_messages_survive_parquet_and_datasets(tmp_path):
    import datasets
    import pandas as pd

    rows = [ROWS[1], ROWS[1]]
    pd.DataFrame(rows).to_parquet(tmp_path / "m.parquet")
    assert load_rows(tmp_path / "m.parquet") == rows
    assert load_rows(datasets.Dataset.from_list(rows)) == rows


def test_mixed_csv_columns_are_per_row(tmp_path):
    (tmp_path / "mix.csv").write_text("prompt,completion,text\na,b,\n,,hello\n")
    rows = load_rows(tmp_path / "mix.csv")
    assert [row_format(r) for r in rows] == ["prompt/completion", "text"]


def test_malformed_json_line_names_its_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "a"}\n{"text": "b"}\n{"text": oops}\n')
    with pytest.raises(ConfigError, match=r"line 3 is not valid JSON"):
        load_rows(p)


def test_empty_dataset(tmp_path):
    p = tmp_path / "empty.jsonl"
    p.write_text("\n")
    with pytest.raises(ConfigError, match="has no rows"):
        load_rows(p)
    with pytest.raises(ConfigError, match="has no rows"):
        load_rows([])


def test_row_in_no_format_names_index_keys_and_formats():
    with pytest.raises(ConfigError) as e:
        load_rows([{"text": "ok"}, {"text": "ok"}, {"question": "q", "answer": "a"}])
    msg = str(e.value)
    assert "row 2" in msg and "'question', 'answer'" in msg
    assert "'prompt' + 'completion'" in msg and "'messages'" in msg and "'text'" in msg
    with pytest.raises(ConfigError, match="assistant"):
        load_rows([{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ConfigError, match="row 0 is in none"):
        load_rows(["just a string"])


def test_unsupported_source_type():
    with pytest.raises(ConfigError, match="not supported"):
        load_rows(42)


# ----------------------------------------------------------------------------------------- loss mask
def test_prompt_completion_loss_only_on_completion(tok):
    ex = encode_row(ROWS[0], tok, 128)
    assert _targets(tok, ex) == "tac" + tok.eos_token
    assert tok.decode(ex.input_ids).startswith("Reverse the word: cat")
    assert ex.n_targets == len(tok("tac", add_special_tokens=False)["input_ids"]) + 1


def test_messages_loss_only_on_assistant_turns(tok):
    conv = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2 plus 3?"},
            {"role": "assistant", "content": "5"},
            {"role": "user", "content": "And 4 plus 4?"},
            {"role": "assistant", "content": "8"},
        ]
    }
    ex = encode_row(conv, tok, 256)
    full = tok.decode(ex.input_ids)
    assert full == tok.apply_chat_template(conv["messages"], tokenize=False)
    # each answer and its end-of-turn marker; not the newline the template writes between turns
    assert _targets(tok, ex) == "5<|im_end|>8<|im_end|>"


def test_conversational_prompt_completion(tok):
    row = {
        "prompt": [{"role": "user", "content": "hi"}],
        "completion": [{"role": "assistant", "content": "yo"}],
    }
    assert _targets(tok, encode_row(row, tok, 64)) == "yo<|im_end|>\n"


def test_text_trains_every_token_and_truncates(tok):
    ex = encode_row(ROWS[2], tok, 128)
    assert all(lab != IGNORE for lab in ex.labels)
    short = encode_row(ROWS[2], tok, 3)
    assert len(short.input_ids) == len(short.labels) == 3


def test_messages_need_a_chat_template(tok):
    import copy

    plain = copy.deepcopy(tok)
    plain.chat_template = None
    with pytest.raises(ConfigError, match="chat template"):
        encode_row(ROWS[1], plain, 64)


def test_collate_right_pads(tok):
    exs = [encode_row(r, tok, 64) for r in ROWS]
    longest = max(len(e.input_ids) for e in exs)
    b = collate(exs, longest + 2, tok.pad_token_id)
    assert b["input_ids"].shape == (3, longest + 2)
    for i, e in enumerate(exs):
        n = len(e.input_ids)
        assert b["attention_mask"][i].tolist() == [1] * n + [0] * (longest + 2 - n)
        assert b["labels"][i, n:].eq(IGNORE).all()


# ------------------------------------------------------------------------------------------ sharding
def _rows(n):
    return [{"prompt": f"Repeat {i}\n", "completion": f"{i}"} for i in range(n)]


def test_epoch_order_is_seeded_and_per_epoch():
    assert epoch_order(50, 1, 0) == epoch_order(50, 1, 0)
    assert epoch_order(50, 1, 0) != epoch_order(50, 1, 1)
    assert epoch_order(50, 1, 0) != epoch_order(50, 2, 0)
    assert sorted(epoch_order(50, 1, 3)) == list(range(50))


@pytest.mark.parametrize("world", [2, 3])
def test_n_ranks_see_the_rows_one_rank_sees(tok, world):
    rows = _rows(61)
    B, GA = 2, 2
    one = ShardedBatches(
        rows, tok, max_length=32, batch_size=world * B, grad_accum=GA, seed=7, rank=0, world_size=1
    )
    ranks = [
        ShardedBatches(
            rows, tok, max_length=32, batch_size=B, grad_accum=GA, seed=7, rank=r, world_size=world
        )
        for r in range(world)
    ]
    assert all(r.steps_per_epoch == one.steps_per_epoch for r in ranks)
    order = [epoch_order(61, 7, e) for e in range(3)]
    for step in range(2 * one.steps_per_epoch + 1):  # crosses epoch boundaries
        for a in range(GA):
            want = sorted(tuple(e.input_ids) for e in one.micro_batch(step, a))
            got = sorted(tuple(e.input_ids) for r in ranks for e in r.micro_batch(step, a))
            assert got == want
    # rank r takes positions r, r+N, ... of the epoch's order
    for r, sb in enumerate(ranks):
        assert sb.shard(0) == order[0][r::world]
    # the epoch's last step takes the rows left over (61 is not a multiple of the global batch)
    assert one.steps_per_epoch == -(-61 // (world * B * GA))
    seen = [
        e.input_ids
        for step in range(one.steps_per_epoch)
        for a in range(GA)
        for e in one.micro_batch(step, a)
    ]
    assert sorted(map(tuple, seen)) == sorted(tuple(one.example(i).input_ids) for i in range(61))
    # what a checkpoint records as consumed: the short last step counts only the rows it had
    for sb in (one, *ranks):
        assert sb.consumed(one.steps_per_epoch) == 61
        assert sb.consumed(one.steps_per_epoch - 1) == (one.steps_per_epoch - 1) * world * B * GA
        assert sb.consumed(2 * one.steps_per_epoch + 1) == 2 * 61 + world * B * GA
        assert sb.consumed(0) == 0


@pytest.mark.parametrize("packing", [False, True])
def test_the_epoch_order_is_computed_once_per_epoch(tok, monkeypatch, packing):
    from nbtrain.data import loader as data

    calls: list[int] = []
    real = data.epoch_order

    def counted(n, seed, epoch):
        calls.append(epoch)
        return real(n, seed, epoch)

    # with packing, the epoch's stream of rows (where each row ends in it) is per-epoch work too
    streams: list[int] = []
    real_ends = data._ends

    def counted_ends(examples):
        streams.append(len(examples))
        return real_ends(examples)

    monkeypatch.setattr(data, "epoch_order", counted)
    monkeypatch.setattr(data, "_ends", counted_ends)
    sb = ShardedBatches(
        _rows(40),
        tok,
        max_length=16,
        batch_size=2,
        grad_accum=2,
        seed=0,
        rank=1,
        world_size=2,
        packing=packing,
    )
    # the training loop's order: every micro-batch of every step, over two and a half epochs
    steps = 2 * sb.steps_per_epoch + sb.steps_per_epoch // 2
    taken = [sb.micro_batch(step, a) for step in range(steps) for a in range(2)]
    assert sum(len(b) for b in taken) > steps  # the micro-batches were real ones
    assert calls == [0, 1, 2]
    assert len(streams) == (3 if packing else 0)


def test_every_row_is_tokenized_before_the_first_batch(tok):
    rows = _rows(40)
    sb = ShardedBatches(
        rows, tok, max_length=32, batch_size=4, grad_accum=1, seed=0, rank=1, world_size=2
    )
    assert [sb.example(i).input_ids for i in range(40)] == [
        encode_row(r, tok, 32).input_ids for r in rows
    ]


def test_too_few_rows_for_one_step(tok):
    with pytest.raises(
        ConfigError,
        match=r"a step takes 16 .*2 ranks x per_device_train_batch_size 4 x gradient_accumulation_steps 2",
    ):
        ShardedBatches(
            _rows(10), tok, max_length=32, batch_size=4, grad_accum=2, seed=0, rank=0, world_size=2
        )


def test_packing_fills_max_length_blocks(tok):
    sb = ShardedBatches(
        _rows(100),
        tok,
        max_length=16,
        batch_size=2,
        grad_accum=1,
        seed=0,
        rank=0,
        world_size=1,
        packing=True,
    )
    batch = sb.micro_batch(0, 0)
    assert [len(e.input_ids) for e in batch] == [16, 16]
    total = sum(len(encode_row(r, tok, None).input_ids) for r in _rows(100))
    # every token is in a block; the last block and the last step take what is left
    assert sb.n_units == -(-total // 16)
    assert sb.steps_per_epoch == -(-sb.n_units // 2)
    last = sb.micro_batch(sb.steps_per_epoch - 1, 0)
    assert sum(len(e.input_ids) for e in last) == total - 16 * 2 * (sb.steps_per_epoch - 1)


def test_eval_shards_cover_every_row_once(tok):
    rows = _rows(11)
    got = []
    for r in range(3):
        for batch in eval_batches(rows, tok, max_length=32, batch_size=2, rank=r, world_size=3):
            got += [tuple(e.input_ids) for e in batch]
    assert sorted(got) == sorted(tuple(encode_row(x, tok, 32).input_ids) for x in rows)


# ---------------------------------------------------------------------- one tokenizer call per row
def _sentencepiece_tokenizer():
    """A Llama-2-style tokenizer: BPE under a Metaspace pre-tokenizer that puts "▁" before each call's text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from nbtrain.model.tiny import CHAT_TEMPLATE

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tk.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"],
        show_progress=False,
    )
    corpus = [
        "Answer: cat",
        "Answer: tac",
        "attack stack tact",
        "<|im_start|>user\ncat<|im_end|>\n<|im_start|>assistant\ntac<|im_end|>\n",
    ] * 20
    tk.train_from_iterator(corpus, trainer)
    tk.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tk.token_to_id("<s>"))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
    )


SP_ROWS = [
    {"prompt": "Answer:", "completion": "tac"},
    {
        "messages": [
            {"role": "user", "content": "cat"},
            {"role": "assistant", "content": "tac"},
        ]
    },
]


def test_completion_ids_are_those_of_the_joint_tokenization():
    sp = _sentencepiece_tokenizer()
    # the tokenizer adds "▁" at the start of each call: "tac" alone is not what follows "Answer:"
    joint = sp("Answer:tac", return_offsets_mapping=True)
    tail = [t for t, (s, e) in zip(joint["input_ids"], joint["offset_mapping"]) if e > 7]
    assert tail != sp("tac", add_special_tokens=False)["input_ids"], (
        "no SentencePiece problem shown"
    )

    ex = encode_row(SP_ROWS[0], sp, 64)
    assert ex.input_ids == joint["input_ids"] + [sp.eos_token_id]
    assert [t for t in ex.labels if t != IGNORE] == tail + [sp.eos_token_id]

    # the same for an assistant turn rendered by the chat template
    conv = SP_ROWS[1]["messages"]
    text = sp.apply_chat_template(conv, tokenize=False)
    prefix = sp.apply_chat_template(conv[:1], tokenize=False, add_generation_prompt=True)
    ex = encode_row(SP_ROWS[1], sp, 64)
    joint = sp(text, add_special_tokens=False, return_offsets_mapping=True)
    end = text.index("<|im_end|>", len(prefix)) + len(
        "<|im_end|>"
    )  # the answer and its end-of-turn
    assert ex.input_ids == joint["input_ids"]
    want = [
        t
        for t, (s, e) in zip(joint["input_ids"], joint["offset_mapping"], strict=True)
        if e > len(prefix) and e > s and s < end
    ]
    assert [t for t in ex.labels if t != IGNORE] == want
    # the assistant text tokenized on its own starts with another token
    turn = text[len(prefix) :]
    assert want[0] != sp(turn, add_special_tokens=False)["input_ids"][0]


class _Slow:
    """A tokenizer without offsets (a Python tokenizer): calls with return_offsets_mapping fail."""

    is_fast = False

    def __init__(self, fast):
        self._fast = fast

    def __getattr__(self, name):
        return getattr(self._fast, name)

    def __call__(self, text, return_offsets_mapping=False, **kw):
        if return_offsets_mapping:
            raise NotImplementedError("no offsets in a Python tokenizer")
        out = self._fast(text, **kw)
        return {"input_ids": out["input_ids"]}


@pytest.mark.parametrize("which", ["sentencepiece", "bytelevel"])
def test_tokenizers_without_offsets_mask_the_same_tokens(tok, which):
    fast = _sentencepiece_tokenizer() if which == "sentencepiece" else tok
    for row in SP_ROWS + ROWS:
        assert encode_row(row, _Slow(fast), 64) == encode_row(row, fast, 64), row


# ------------------------------------------------------------------ bad rows, long rows, no targets
def test_a_bad_row_is_found_before_training_with_its_index(tok):
    import copy

    strict = copy.deepcopy(tok)
    strict.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    rows = _rows(30)
    rows[23] = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"},
        ]
    }
    # rank 0 of 2: row 23 may belong to rank 1 in every epoch; rank 0 still finds it, in the constructor
    with pytest.raises(
        ConfigError, match=r"data row 23: the chat template could not render it"
    ) as e:
        ShardedBatches(
            rows, strict, max_length=32, batch_size=2, grad_accum=1, seed=0, rank=0, world_size=2
        )
    assert "System role not supported" in str(e.value)
    plain = copy.deepcopy(tok)
    plain.chat_template = None
    with pytest.raises(ConfigError, match=r"data row 23: rows in the 'messages' format need"):
        ShardedBatches(
            rows, plain, max_length=32, batch_size=2, grad_accum=1, seed=0, rank=1, world_size=2
        )


def test_long_rows_are_counted_and_rows_without_targets_dropped(tok, capsys):
    rows = _rows(20)
    rows[3] = {"prompt": "a very long prompt " * 20, "completion": "x"}  # no target within 16
    rows[7] = {"text": "a long text row " * 10}
    rows[11] = {"prompt": "Q\n", "completion": "a long answer " * 10}
    sb = ShardedBatches(
        rows, tok, max_length=16, batch_size=2, grad_accum=1, seed=0, rank=0, world_size=1
    )
    out = capsys.readouterr().out
    assert "3 of 20 rows are longer than max_length=16 tokens and are cut at the right" in out
    assert "1 of 20 rows have no target token within max_length=16 and are skipped (rows 3)" in out
    assert 3 not in sb.kept and len(sb.kept) == 19
    seen = [e for s in range(sb.steps_per_epoch) for e in sb.micro_batch(s, 0)]
    assert len(seen) == 19 and sb.example(3) not in seen
    # a cut row loses its eos at the right; cut at the left it keeps its end
    assert sb.example(11).input_ids[-1] != tok.eos_token_id
    left = ShardedBatches(
        rows,
        tok,
        max_length=16,
        batch_size=2,
        grad_accum=1,
        seed=0,
        rank=1,
        world_size=2,
        truncation_side="left",
    )
    assert capsys.readouterr().out == ""  # only rank 0 reports
    full = encode_row(rows[11], tok, None)
    assert left.example(11).input_ids == full.input_ids[-16:]
    assert left.example(3).n_targets > 0 and 3 in left.kept  # the completion survives at the left


def test_rows_with_no_target_at_all_is_an_error(tok):
    rows = [{"prompt": "a very long prompt " * 20, "completion": "x"}] * 8
    with pytest.raises(
        ConfigError, match="none of the 8 rows has a target token within max_length=8"
    ):
        ShardedBatches(
            rows, tok, max_length=8, batch_size=2, grad_accum=1, seed=0, rank=0, world_size=1
        )


def test_last_partial_step_and_an_empty_micro_batch(tok):
    rows = _rows(13)
    world, B, GA = 2, 2, 2
    ranks = [
        ShardedBatches(
            rows, tok, max_length=32, batch_size=B, grad_accum=GA, seed=5, rank=r, world_size=world
        )
        for r in range(world)
    ]
    assert all(sb.steps_per_epoch == 2 for sb in ranks)  # ceil(13 / 8)
    last = [[sb.micro_batch(1, a) for a in range(GA)] for sb in ranks]
    # 5 rows left: micro-batch 0 takes 4 (2 per rank), micro-batch 1 takes 1 (rank 0), rank 1 none
    assert [[len(m) for m in r] for r in last] == [[2, 1], [2, 0]]
    b = ranks[1].collate(last[1][1], 7)
    assert b["input_ids"].shape == (1, 7) and b["labels"].eq(IGNORE).all()
    # every row of the epoch is trained on exactly once
    seen = sorted(
        tuple(e.input_ids)
        for sb in ranks
        for s in range(2)
        for a in range(GA)
        for e in sb.micro_batch(s, a)
    )
    assert seen == sorted(tuple(encode_row(r, tok, 32).input_ids) for r in rows)
