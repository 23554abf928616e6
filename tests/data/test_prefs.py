"""DPOConfig's checks and the preference rows' (nbtrain/data/prefs.py): bad settings and bad rows are refused
before any step, naming what is wrong and where; the implicit prompt is cut as TRL cuts it."""

from __future__ import annotations

import json

import pytest

import nbtrain
from nbtrain.data.prefs import extract_prompt
from nbtrain.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GOOD = {"prompt": "Say hi.\nAnswer:", "chosen": " hi", "rejected": " bye"}


def _cfg(tiny, data, out, **kw):
    return nbtrain.DPOConfig(
        model=tiny, data=data, output_dir=str(out), max_steps=1, data_cache="off", **kw
    )


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"loss_type": "hinge"}, "loss_type='hinge' is not supported; use one of sigmoid, ipo"),
        ({"beta": 0}, "beta=0 must be a number > 0"),
        ({"packing": True}, "packing and padding_free are not supported for DPO"),
        ({"per_device_train_batch_size": "auto"}, "'auto' is not supported for DPO"),
        ({"max_prompt_length": 0}, "max_prompt_length=0 must be None or an integer >= 1"),
        ({"betta": 0.2}, "unknown setting betta (did you mean beta?)"),
    ],
)
def test_bad_settings(tiny, tmp_path, kw, words):
    with pytest.raises(ConfigError) as err:
        _cfg(tiny, [GOOD], tmp_path / "out", **kw)
    assert words in str(err.value)


def test_loss_type_list_form(tiny, tmp_path):
    assert _cfg(tiny, [GOOD], tmp_path / "out", loss_type=["ipo"]).loss_type == "ipo"


def test_a_finished_run_is_not_overwritten(tiny, tmp_path):
    out = tmp_path / "done"
    nbtrain.finetune(_cfg(tiny, [GOOD] * 4, out, save_steps=None))
    before = (out / "adapter" / "adapter_model.safetensors").read_bytes()
    with pytest.raises(
        ConfigError, match=r"holds another run \(adapter, metrics.jsonl, .*overwrite=True"
    ):
        nbtrain.finetune(_cfg(tiny, [GOOD] * 4, out, save_steps=None, learning_rate=1e-3))
    assert (out / "adapter" / "adapter_model.safetensors").read_bytes() == before
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1


def test_sft_rows_given_to_dpo_are_told_in_one_line(tiny, tmp_path):
    data = tmp_path / "sft.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"Say {i}.", "completion": " hi"}) + "\n" for i in range(30))
    )
    with pytest.raises(ConfigError) as err:
        nbtrain.finetune(_cfg(tiny, str(data), tmp_path / "out"))
    assert str(err.value) == (
        f"data file {str(data)!r}: all 30 rows have keys 'prompt', 'completion'; preference rows "
        "need 'prompt' + 'chosen' + 'rejected' (strings or lists of messages), or 'chosen' + "
        "'rejected' (SFT rows go to nbtrain.SFTConfig); nothing was trained or cached"
    )
    assert not (tmp_path / "out").exists()


def test_bad_rows_refused_with_file_line_and_index(tiny, tmp_path):
    """Every bad row is named with its file, line and index, and nothing is trained or written."""
    rows = [
        GOOD,
        {"prompt": "Say hi.", "chosen": " hi"},
        {"prompt": "Say hi.", "completion": " hi"},
        {"prompt": "Say hi.", "chosen": " hi", "rejected": [{"role": "assistant", "content": "x"}]},
        {"prompt": "Say hi.", "chosen": " same", "rejected": " same"},
        GOOD,
    ]
    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    with pytest.raises(ConfigError) as err:
        nbtrain.finetune(_cfg(tiny, str(data), out))
    text = str(err.value)
    assert "4 of 6 rows are refused" in text
    assert "line 2" in text and "row 1: the row is not a preference pair" in text
    assert "row 2" in text and "SFT rows go to nbtrain.SFTConfig" in text
    assert "line 4" in text and "must all be strings or all be non-empty lists" in text
    assert "line 5" in text and "'chosen' and 'rejected' are the same" in text
    assert not out.exists()


def test_no_chat_template_refused(tmp_path):
    from pathlib import Path

    from nbtrain.model.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny")
    (Path(model) / "chat_template.jinja").unlink(missing_ok=True)
    config = Path(model) / "tokenizer_config.json"
    config.write_text(
        json.dumps(
            {k: v for k, v in json.loads(config.read_text()).items() if k != "chat_template"}
        )
    )
    row = {
        "prompt": [{"role": "user", "content": "Say hi."}],
        "chosen": [{"role": "assistant", "content": "hi"}],
        "rejected": [{"role": "assistant", "content": "bye"}],
    }
    with pytest.raises(ConfigError, match="need a tokenizer with a chat template"):
        nbtrain.finetune(_cfg(model, [row], tmp_path / "out"))


def test_implicit_prompt_as_trl_cuts_it():
    from trl.data_utils import extract_prompt as trl_extract

    cases = [
        ("Q: 2+2?\nA: 4", "Q: 2+2?\nA: 5"),
        ("The sky is blue", "The sky is green"),
        ("abc", "abd"),
        (
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}],
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "b"}],
        ),
    ]
    for chosen, rejected in cases:
        want = trl_extract({"chosen": chosen, "rejected": rejected})
        assert extract_prompt(chosen, rejected) == (
            want["prompt"],
            want["chosen"],
            want["rejected"],
        )


def test_cut_as_trl_cuts():
    """max_prompt_length keeps the prompt's end, max_completion_length each completion's start (older
    TRL's limits), then max_length cuts prompt + completion at truncation_side."""
    from nbtrain.data.prefs import Cut, Pair, collate

    pair = Pair(0, [1, 2, 3, 4], [5, 6, 7], [8, 9])
    assert Cut(None, "right", 2, 2).seqs(pair) == [
        ([3, 4, 5, 6], [0, 0, 1, 1]),
        ([3, 4, 8, 9], [0, 0, 1, 1]),
    ]
    assert Cut(5, "right").seqs(pair) == [
        ([1, 2, 3, 4, 5], [0, 0, 0, 0, 1]),
        ([1, 2, 3, 4, 8], [0, 0, 0, 0, 1]),
    ]
    assert Cut(3, "left").seqs(pair)[1] == ([4, 8, 9], [0, 1, 1])
    batch = collate([pair], 8, 0, Cut(None))
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 0], [1, 2, 3, 4, 8, 9, 0, 0]]
    assert batch["completion_mask"].tolist() == [[0, 0, 0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 1, 1, 0, 0]]
    assert batch["attention_mask"].sum().item() == 13 and batch["real"].tolist() == [True]
    # a rank with no pair left: one stand-in pair of pad tokens, with nothing to score
    empty = collate([], 1, 0, Cut(None))
    assert empty["real"].tolist() == [False] and empty["completion_mask"].sum().item() == 0


def test_bad_eval_rows_refused(tiny, tmp_path):
    rows = [GOOD, {"prompt": "Say hi.", "completion": " hi"}]
    with pytest.raises(ConfigError) as err:
        nbtrain.finetune(_cfg(tiny, [GOOD] * 4, tmp_path / "out", eval_data=rows))
    assert "eval_data row 1: the row is not a preference pair" in str(err.value)
    assert not (tmp_path / "out").exists()
