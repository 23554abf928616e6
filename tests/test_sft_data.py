"""Data: every accepted source and row format, loss masks, and sharding across ranks."""

from __future__ import annotations

import json

import pytest

from nbtrain.errors import ConfigError
from nbtrain.sft.data import (
    IGNORE,
    ShardedBatches,
    collate,
    encode_row,
    epoch_order,
    eval_batches,
    load_rows,
    row_format,
)

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
    from nbtrain.sft.tiny import make_tiny_tokenizer

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
    assert _targets(tok, ex) == "5<|im_end|>\n8<|im_end|>\n"


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
    # rank r takes positions r, r+N, ... of the epoch's order, and tokenizes only those rows
    for r, sb in enumerate(ranks):
        assert sb.shard(0) == order[0][r::world]
        assert set(sb._cache) <= set(order[0][r::world]) | set(order[1][r::world]) | set(
            order[2][r::world]
        )


def test_each_rank_tokenizes_only_its_shard(tok):
    rows = _rows(40)
    sb = ShardedBatches(
        rows, tok, max_length=32, batch_size=4, grad_accum=1, seed=0, rank=1, world_size=2
    )
    for step in range(sb.steps_per_epoch):
        sb.micro_batch(step, 0)
    assert set(sb._cache) == set(epoch_order(40, 0, 0)[1::2])


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
    total = sum(len(encode_row(r, tok, 16).input_ids) for r in _rows(100))
    assert sb.steps_per_epoch == total // 16 // 2


def test_eval_shards_cover_every_row_once(tok):
    rows = _rows(11)
    got = []
    for r in range(3):
        for batch in eval_batches(rows, tok, max_length=32, batch_size=2, rank=r, world_size=3):
            got += [tuple(e.input_ids) for e in batch]
    assert sorted(got) == sorted(tuple(encode_row(x, tok, 32).input_ids) for x in rows)
