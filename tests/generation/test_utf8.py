"""nbtrain/generation/utf8.py: a completion cut inside a character's bytes ends without U+FFFD."""

from __future__ import annotations

import pytest

from nbtrain.generation.utf8 import cut_bytes, decode_completion
from nbtrain.model.tiny import make_tiny_tokenizer

TEXT = "café 😀 ok"


@pytest.fixture(scope="module")
def tok():
    # the tests' real byte-level BPE tokenizer (nbtrain.model.tiny), trained on its small corpus
    return make_tiny_tokenizer()


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_a_cut_inside_a_character_drops_its_half(tok):
    ids = _ids(tok, TEXT)
    seen = {}
    for n in range(len(ids) + 1):
        got = decode_completion(tok, ids[:n])
        assert "\ufffd" not in got
        # what is shown is the decoded text up to the cut character, never more, never less
        full = tok.decode(ids[:n])
        assert full.startswith(got) and set(full[len(got) :]) <= {"\ufffd"}
        seen[n] = got
    # both cut characters were cut (each of "é" and the emoji spans several tokens here)
    cuts = [n for n in seen if tok.decode(ids[:n]).endswith("\ufffd")]
    assert [seen[n] for n in cuts] == ["caf"] + ["café "] * (len(cuts) - 1)
    assert len(cuts) >= 2  # "é" cut once, the emoji's 4 bytes at least once
    assert seen[len(ids)] == TEXT
    assert cut_bytes(tok, ids[: cuts[0]]) == "é".encode()[:1]


def test_a_replacement_character_the_model_wrote_stays(tok):
    ids = _ids(tok, "a \ufffd b \ufffd")
    assert decode_completion(tok, ids) == "a \ufffd b \ufffd"
    assert cut_bytes(tok, ids) == b""
    # a whole U+FFFD, then a cut "é": only the cut goes
    cut = _ids(tok, "a \ufffd") + _ids(tok, "é")[:1]
    assert tok.decode(cut) == "a \ufffd\ufffd"
    assert decode_completion(tok, cut) == "a \ufffd"


def test_an_end_of_sequence_token_after_the_cut_is_seen_through(tok):
    # decode.py keeps the stop id in a completion's ids: the cut is before it
    ids = _ids(tok, "café")
    cut = [i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd")][0]
    with_eos = ids[:cut] + [tok.eos_token_id]
    assert decode_completion(tok, with_eos) == "caf"
