"""Real chat templates (tests/fixtures/templates): what nbtrain trains on each is what an independent
reference says: each assistant turn's text as the whole rendering shows it, found by string search, plus
the family's end-of-turn string, mapped to tokens by offsets. Also the rows refused, and content forms."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from nbtrain.data.rows import IGNORE, encode_rows
from nbtrain.errors import ConfigError

FIXTURES = Path(__file__).parents[1] / "fixtures" / "templates"
FAMILIES = sorted(p.stem for p in FIXTURES.glob("*.json"))
CORPUS = ["Paris is the capital of France.", "It is sunny in Rome.", "user assistant system"] * 5

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def _fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text(encoding="utf-8"))


_TOKENIZERS: dict[str, object] = {}


def _tokenizer(name: str, tmp_path_factory) -> object:
    """A tiny byte-level BPE with the family's special tokens and its real template, saved and reloaded."""
    if name in _TOKENIZERS:
        return _TOKENIZERS[name]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    fx = _fixture(name)
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=fx["special_tokens"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(CORPUS, trainer)
    named = (fx["bos_token"], fx["eos_token"])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token=fx["bos_token"],
        eos_token=fx["eos_token"],
        additional_special_tokens=[s for s in fx["special_tokens"] if s not in named],
    )
    tok.chat_template = fx["chat_template"]
    folder = tmp_path_factory.mktemp(name)
    tok.save_pretrained(folder)
    _TOKENIZERS[name] = AutoTokenizer.from_pretrained(folder)
    return _TOKENIZERS[name]


# ------------------------------------------------------------------------------------- conversations
SYSTEM = {"role": "system", "content": "Be brief."}
QA = [
    ("Capital of France?", "Paris."),
    ("And of Italy?", "Rome is."),
    ("Which is larger?", "Paris, by far."),
    ("Thanks!", "You are welcome."),
]


def _conv(turns: int, system: bool) -> list[dict]:
    msgs = [SYSTEM] if system else []
    for q, a in QA[:turns]:
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return msgs


def _reference(tok, text: str, shown: list[str], eot: str, after: list[str]) -> list[int]:
    """Token ids holding any character of `shown[i] + eot`, each found by string search in order,
    after the text `after[i]` (the user turn before it: a default system prompt may say "Paris.")."""
    spans, cursor = [], 0
    for s, before in zip(shown, after, strict=True):
        cursor = text.index(before, cursor) + len(before)
        at = text.index(s, cursor)
        assert text.startswith(eot, at + len(s)), (text[at:], eot)
        spans.append((at, at + len(s) + len(eot)))
        cursor = at + len(s) + len(eot)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    return [
        t
        for t, (a, b) in zip(enc["input_ids"], enc["offset_mapping"], strict=True)
        if b > a and any(a < e and b > s for s, e in spans)
    ]


def _trained(ex) -> list[int]:
    return [t for t, lab in zip(ex.input_ids, ex.labels, strict=True) if lab != IGNORE]


def _check(tok, row: dict, shown: list[str], eot: str, **kwargs) -> None:
    (ex,), _ = encode_rows([row], tok, None)
    text = tok.apply_chat_template(
        row["messages"], tokenize=False, tools=row.get("tools"), **kwargs
    )
    assert ex.input_ids == tok(text, add_special_tokens=False)["input_ids"]
    msgs = row["messages"]
    after = [
        next(p["content"] for p in reversed(msgs[:i]) if p["role"] in ("user", "tool"))
        for i, m in enumerate(msgs)
        if m["role"] == "assistant"
    ]
    want = _reference(tok, text, shown, eot, after)
    assert _trained(ex) == want
    assert tok.decode(_trained(ex)) == "".join(s + eot for s in shown)


@pytest.mark.parametrize("turns", [1, 2, 3, 4])
@pytest.mark.parametrize("system", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_assistant_turns_and_their_end_of_turn_are_trained(family, turns, system, tmp_path_factory):
    fx = _fixture(family)
    if system and not fx["system"]:
        pytest.skip(f"{fx['family']}'s template refuses system messages")
    tok = _tokenizer(family, tmp_path_factory)
    msgs = _conv(turns, system)
    shown = [m["content"] for m in msgs if m["role"] == "assistant"]
    if family == "qwen3":  # the final answer is rendered with its (here empty) reasoning block
        shown[-1] = "<think>\n\n</think>\n\n" + shown[-1]
    _check(tok, {"messages": msgs}, shown, fx["eot"])


def test_the_old_prefix_refusal_is_gone_qwen3_two_turns_with_reasoning(tmp_path_factory):
    """Qwen3 drops earlier turns' reasoning: they train as shown, the last turn with its reasoning."""
    tok = _tokenizer("qwen3", tmp_path_factory)
    msgs = [
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "<think>\nEasy one.\n</think>\n\nParis."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "<think>\nAlso easy.\n</think>\n\nRome is."},
    ]
    shown = ["Paris.", "<think>\nAlso easy.\n</think>\n\nRome is."]
    _check(tok, {"messages": msgs}, shown, "<|im_end|>")
    # the same with reasoning_content, and with enable_thinking off (TRL's per-row chat_template_kwargs)
    split = [
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris.", "reasoning_content": "Easy one."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome is.", "reasoning_content": "Also easy."},
    ]
    for kwargs in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
        row = {"messages": split, "chat_template_kwargs": kwargs}
        _check(tok, row, shown, "<|im_end|>", **kwargs)


def test_deepseek_r1_trains_the_answers_it_shows(tmp_path_factory):
    """The R1 distill template drops every turn's reasoning, the last one's too."""
    tok = _tokenizer("deepseek_r1_distill", tmp_path_factory)
    msgs = [
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "<think>\nEasy one.\n</think>\n\nParis."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "<think>\nAlso easy.\n</think>\n\nRome is."},
    ]
    _check(tok, {"messages": msgs}, ["Paris.", "Rome is."], "<｜end▁of▁sentence｜>")


# tool calls as TRL's conversational format has them, and what each family renders for the call
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
RENDERED_CALL = {
    "qwen2_5": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "qwen3": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "llama3_1": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "llama3_2": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
}


@pytest.mark.parametrize("content", ["absent", "none"])
@pytest.mark.parametrize("system", [False, True])
@pytest.mark.parametrize("family", sorted(RENDERED_CALL))
def test_tool_calls_and_results(family, system, content, tmp_path_factory):
    fx = _fixture(family)
    tok = _tokenizer(family, tmp_path_factory)
    call = {"role": "assistant", "tool_calls": [CALL]}
    if content == "none":
        call["content"] = None
    msgs = [SYSTEM] if system else []
    msgs += [
        {"role": "user", "content": "Weather in Paris?"},
        call,
        {"role": "tool", "name": "get_weather", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
    ]
    last = "It is sunny."
    if family == "qwen3":
        last = "<think>\n\n</think>\n\n" + last
    _check(tok, {"messages": msgs, "tools": TOOLS}, [RENDERED_CALL[family], last], fx["eot"])


# ------------------------------------------------------------------------------------- content forms
def test_text_parts_are_joined_before_the_template_sees_them(tmp_path_factory):
    for family in ("chatml", "llama3_1", "gemma3", "mistral_v7"):
        tok = _tokenizer(family, tmp_path_factory)
        parts = [{"type": "text", "text": "Paris "}, {"type": "text", "text": "is."}]
        row = {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Capital of France?"}]},
                {"role": "assistant", "content": parts},
            ]
        }
        plain = {
            "messages": [
                {"role": "user", "content": "Capital of France?"},
                {"role": "assistant", "content": "Paris is."},
            ]
        }
        (ex,), _ = encode_rows([row], tok, None)
        (want,), _ = encode_rows([plain], tok, None)
        assert ex == want, family
        assert tok.decode(_trained(ex)) == "Paris is." + _fixture(family)["eot"]


# ------------------------------------------------------------------------------------------ refusals
def _refused(tok, messages: list[dict], match: str) -> str:
    with pytest.raises(ConfigError, match=match) as e:
        encode_rows([{"text": "fine"}, {"messages": messages}], tok, None, where="train.jsonl")
    assert str(e.value).startswith("train.jsonl row 1: ")
    return str(e.value)


USER = {"role": "user", "content": "Capital of France?"}


def test_non_text_parts_are_refused(tmp_path_factory):
    tok = _tokenizer("chatml", tmp_path_factory)
    image = {"type": "image", "url": "cat.png"}
    msg = _refused(
        tok,
        [{"role": "user", "content": [image]}, {"role": "assistant", "content": "A cat."}],
        r"message 0 has a 'image' part",
    )
    assert "text models" in msg


@pytest.mark.parametrize("value", [42, 3.5, True, {"text": "x"}])
def test_numbers_and_other_content_are_refused(value, tmp_path_factory):
    tok = _tokenizer("chatml", tmp_path_factory)
    msg = _refused(
        tok,
        [USER, {"role": "assistant", "content": value}],
        r"message 1 \(assistant\) has content of type",
    )
    assert "give a string" in msg


def test_none_is_refused_except_beside_tool_calls(tmp_path_factory):
    tok = _tokenizer("chatml", tmp_path_factory)
    _refused(
        tok,
        [USER, {"role": "assistant", "content": None}],
        r"message 1 \(assistant\) has no content",
    )
    _refused(
        tok,
        [{"role": "user", "content": None}, {"role": "assistant", "content": "Paris."}],
        r"message 0 \(user\) has no content",
    )


def test_unknown_roles_are_refused_and_roles_the_template_names_allowed(tmp_path_factory):
    tok = _tokenizer("chatml", tmp_path_factory)
    msg = _refused(
        tok,
        [{"role": "robot", "content": "beep"}, USER, {"role": "assistant", "content": "Paris."}],
        r"message 0 has role 'robot'",
    )
    assert "system, developer, user, assistant, tool" in msg
    _refused(
        tok,
        [USER, {"role": "ipython", "content": "1"}, {"role": "assistant", "content": "Paris."}],
        r"role 'ipython'",
    )
    llama = _tokenizer("llama3_1", tmp_path_factory)  # names 'ipython' in its text
    row = {
        "messages": [
            USER,
            {"role": "ipython", "content": "1"},
            {"role": "assistant", "content": "Paris."},
        ]
    }
    (ex,), _ = encode_rows([row], llama, None)
    assert llama.decode(_trained(ex)) == "Paris.<|eot_id|>"


def test_empty_assistant_turns_are_refused(tmp_path_factory):
    tok = _tokenizer("chatml", tmp_path_factory)
    _refused(tok, [USER, {"role": "assistant", "content": ""}], r"assistant message 1 is empty")
    _refused(tok, [USER, {"role": "assistant", "content": []}], r"assistant message 1 is empty")


# ---------------------------------------------------------------------------- {% generation %} masks
def test_generation_markers_give_the_same_tokens_as_transformers_mask(tmp_path_factory):
    """TRL's training template for Qwen3 marks assistant text: nbtrain trains exactly that mask."""
    import trl

    source = Path(trl.__file__).parent / "chat_templates" / "qwen3_training.jinja"
    tok = copy.deepcopy(_tokenizer("qwen3", tmp_path_factory))
    tok.chat_template = source.read_text(encoding="utf-8")
    for msgs in (_conv(1, False), _conv(3, True)):
        ref = tok.apply_chat_template(
            msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        (ex,), _ = encode_rows([{"messages": msgs}], tok, None)
        assert ex.input_ids == list(ref["input_ids"])
        assert [int(lab != IGNORE) for lab in ex.labels] == list(ref["assistant_masks"])
        assert 1 in ref["assistant_masks"]


# ------------------------------------------------------------------------------------------- speed
def test_one_render_per_row(tmp_path_factory, monkeypatch):
    """A conversation is rendered once, however many assistant turns it has (plus a probe per tokenizer)."""
    import transformers.utils.chat_template_utils as ctu

    from nbtrain.data import chat

    tok = _tokenizer("qwen3", tmp_path_factory)
    calls = []
    real = ctu.render_jinja_template

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(ctu, "render_jinja_template", counting)
    rows = [{"messages": _conv(4, True)}] * 50
    chat._TEMPLATES.clear()
    encode_rows(rows, tok, None)
    assert len(calls) == 50 + 2  # the rows, and the probe (a conversation and a lone user turn)
