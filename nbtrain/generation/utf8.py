"""A completion's text without the half character a length cut leaves at its end.

A completion that reaches `max_new_tokens` can end inside a multi-byte character (an emoji or "é"
whose bytes a byte-level tokenizer spreads over several tokens). Decoding such ids ends in U+FFFD,
the replacement character, which samples.jsonl, the Lab and the live display would then show. Every
writer of a completion's text decodes it with `decode_completion`, which drops that trailing
character, and only that one: a U+FFFD the model wrote as a whole character (its three bytes all
there), or anywhere before the end, stays.

In [1]: decode_completion(tokenizer, ids)  # ids cut after the first byte of "é"
Out[1]: 'caf'
"""

from __future__ import annotations

import codecs
import logging
import re
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["cut_bytes", "decode_completion"]

REPLACEMENT = "\ufffd"
# the longest start of a UTF-8 character that is not yet one: 3 of a 4-byte character's bytes
_MOST_CUT = 3
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level(tokenizer: Any) -> bool:
    """True for a byte-level BPE tokenizer (GPT-2's, Llama 3's, Qwen's): every token is bytes, each
    written as one printable character."""
    if getattr(tokenizer, "byte_decoder", None) is not None:  # transformers' slow GPT-2 tokenizer
        return True
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and type(backend.decoder).__name__ == "ByteLevel"


def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet, read backwards: the printable bytes stand for themselves, the
    others for 256, 257, ... in order (the table every byte-level BPE tokenizer shares)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in printable]
    table.update({chr(256 + n): b for n, b in enumerate(others)})
    return table


def _token_bytes(token: str, byte_level: bool, table: dict[str, int]) -> bytes:
    if byte_level:
        return bytes(table[c] for c in token if c in table)
    found = _BYTE_TOKEN.fullmatch(token)  # SentencePiece's byte fallback: <0xE2>
    if found:
        return bytes([int(found.group(1), 16)])
    return token.replace("\u2581", " ").encode()


def cut_bytes(tokenizer: Any, ids: list[int]) -> bytes:
    """The bytes at the end of `ids` that start a character and do not finish it (b"" when the
    last character is whole): what a cut in the middle of a character leaves."""
    special = set(getattr(tokenizer, "all_special_ids", None) or ())
    kept = [i for i in ids if i not in special]
    if not kept:
        return b""
    byte_level = _byte_level(tokenizer)
    table = _unicode_to_byte() if byte_level else {}
    # each token holds at least one byte: the last _MOST_CUT tokens hold every cut byte
    tokens = tokenizer.convert_ids_to_tokens(kept[-(_MOST_CUT + 1) :])
    tail = b"".join(_token_bytes(t, byte_level, table) for t in tokens)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    decoder.decode(tail, final=False)
    # what the decoder holds back is a valid start of a character that has not ended
    held: bytes = decoder.getstate()[0]
    return held


def decode_completion(tokenizer: Any, ids: list[int], skip_special_tokens: bool = True) -> str:
    """`tokenizer.decode(ids)`, less the U+FFFD a cut inside a character's bytes leaves at the end
    (one for a byte-level tokenizer, one a byte for SentencePiece's byte fallback)."""
    text = str(tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))
    if not text.endswith(REPLACEMENT):
        return text
    held = cut_bytes(tokenizer, ids)
    if not held:
        return text  # the model wrote U+FFFD itself, or bytes no character starts with
    shown = 1 if _byte_level(tokenizer) else len(held)
    if text.endswith(REPLACEMENT * shown):
        return text[: len(text) - shown]
    return text
