"""Chat rows: content forms, message checks, rendering with the chat template, and the trained spans.

A conversation is rendered once, whole, and the loss covers each assistant turn as that final rendering
shows it: from the end of the template's assistant header through the turn's end-of-turn marker
(`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`, ...). Templates that rewrite earlier turns (Qwen3 drops the
reasoning of all but the last answer) therefore work: what is trained is what the model sees.

What a template writes around a turn (its assistant header, its end-of-turn marker, the roles it names)
is learned once per tokenizer and template from a probe conversation, and kept in `_TEMPLATES`. A
template with `{% generation %}` markers states its assistant text itself: its marked spans are used.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any

from nbtrain.errors import ConfigError

log = logging.getLogger(__name__)

ROLES = ("system", "developer", "user", "assistant", "tool")
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
# probe texts: no whitespace (templates trim content) and nothing a template would rewrite
_PROBE = ("NBTPROBEUSERONE", "NBTPROBEANSWERONE", "NBTPROBEUSERTWO", "NBTPROBEANSWERTWO")


@dataclass
class _Template:
    """What is known about one tokenizer's chat template: learned once, used for every row."""

    source: str
    variables: dict[str, Any]  # the tokenizer's special tokens, as apply_chat_template passes them
    generation: bool  # the template marks assistant text with {% generation %}
    header: str = ""  # what precedes an assistant turn's text ("<|im_start|>assistant\n")
    eot: str = ""  # what ends it ("<|im_end|>")
    roles: dict[str, bool] = field(default_factory=dict)


# keyed by the tokenizer's id and everything that changes the rendering: learned once per tokenizer
_TEMPLATES: dict[tuple, _Template] = {}


def check_template(tokenizer: Any) -> None:
    """A ConfigError unless `tokenizer` has a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        msg = (
            "rows in the 'messages' format need a tokenizer with a chat template, and this model's "
            "tokenizer has none; use an instruct/chat model, set tokenizer.chat_template, or convert the "
            "rows to prompt/completion"
        )
        raise ConfigError(msg)


def _render_error(e: Exception) -> ConfigError:
    msg = (
        f"the chat template could not render it ({type(e).__name__}: {e}); change the row to what "
        "the template accepts (many want user and assistant turns to alternate), or convert it "
        "to prompt/completion strings"
    )
    return ConfigError(msg)


def _render(
    t: _Template,
    messages: list[dict],
    *,
    generation_prompt: bool = False,
    tools: Any = None,
    kwargs: dict | None = None,
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text, and the {% generation %} spans where the template has them."""
    from transformers.utils.chat_template_utils import render_jinja_template

    variables = {**t.variables, **kwargs} if kwargs else t.variables
    try:
        # annotated as returning str, it returns (texts, generation spans)
        out: Any = render_jinja_template(
            conversations=[messages],
            tools=tools,
            chat_template=t.source,
            return_assistant_tokens_mask=t.generation,
            add_generation_prompt=generation_prompt,
            **variables,
        )
    except Exception as e:  # a template's raise_exception(...), or one that needs other roles
        raise _render_error(e) from None
    texts, indices = out
    return texts[0], (indices[0] if indices else [])


def _template(tokenizer: Any, tools: Any, kwargs: dict | None) -> _Template:
    source = tokenizer.chat_template
    if not isinstance(source, str):  # named templates ("default", "tool_use")
        source = tokenizer.get_chat_template(None, tools)
    frozen = json.dumps(kwargs, sort_keys=True, default=str) if kwargs else ""
    key = (id(tokenizer), source, tokenizer.bos_token, tokenizer.eos_token, frozen)
    t = _TEMPLATES.get(key)
    if t is None:
        t = _Template(source, dict(tokenizer.special_tokens_map), bool(_GENERATION.search(source)))
        if not t.generation:
            t.header, t.eot = _learn_turn(t, tokenizer, kwargs)
        if len(_TEMPLATES) > 64:  # tokenizers made and dropped in a loop: keep the cache small
            _TEMPLATES.clear()
        _TEMPLATES[key] = t
    return t


def _learn_turn(t: _Template, tokenizer: Any, kwargs: dict | None) -> tuple[str, str]:
    """The template's assistant header and end-of-turn marker, read off a rendered probe conversation."""
    u1, a1, u2, a2 = _PROBE
    conv = [
        {"role": "user", "content": u1},
        {"role": "assistant", "content": a1},
        {"role": "user", "content": u2},
        {"role": "assistant", "content": a2},
    ]
    try:
        full, _ = _render(t, conv, kwargs=kwargs)
        alone, _ = _render(t, conv[:1], kwargs=kwargs)
    except ConfigError:
        return "", ""  # a template that refuses the probe: rows are found by their text alone
    i1, j1, i2, j2 = (full.find(p) for p in _PROBE)
    if min(i1, j1, i2, j2) < 0 or not i1 < j1 < i2 < j2:
        return "", ""
    controls = {
        str(getattr(tok, "content", tok)) for tok in tokenizer.added_tokens_decoder.values()
    } | set(getattr(tokenizer, "all_special_tokens", []))
    # the header is what comes between the user's text and the answer, less what ends a user turn
    # (what a conversation ending on that user turn also has after it, up to a whole token or line:
    # Phi-3.5 ends one with "<|end|>\n<|endoftext|>", then "<|end|>\n<|assistant|>\n" if answered)
    between = full[i1 + len(u1) : j1]
    user_end = alone[alone.find(u1) + len(u1) :] if u1 in alone else ""
    n = len(os.path.commonprefix([between, user_end]))
    while n and between[n - 1] != "\n" and not any(between[:n].endswith(c) for c in controls if c):
        n -= 1
    header = between[n:]
    # the end of a turn is what follows an answer both mid-conversation and at its end ...
    mid, last = full[j1 + len(a1) : i2], full[j2 + len(a2) :]
    tail = os.path.commonprefix([mid, last]) or mid
    # ... up to the first control token in it: "<|im_end|>" of "<|im_end|>\n", "</s>" of " </s>"
    found = [(tail.find(c), c) for c in controls if c and c in tail]
    if found:
        pos, c = min(found, key=lambda x: (x[0], -len(x[1])))
        return header, tail[: pos + len(c)]
    return header, tail.rstrip()


# ------------------------------------------------------------------------------------- content forms
def _text_of(content: list, j: int) -> str:
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append(part["text"])
            continue
        if isinstance(part, str):
            what = "a bare string part"
            fix = "write parts as {'type': 'text', 'text': ...}"
        elif kind in ("image", "image_url", "audio", "input_audio", "video"):
            what = f"a {kind!r} part"
            fix = "this trainer fine-tunes text models: remove non-text parts, or drop the row"
        else:
            what = f"a part {part!r}"
            fix = "give parts as {'type': 'text', 'text': ...}"
        msg = f"message {j} has {what} in its content; {fix}"
        raise ConfigError(msg)
    return "".join(parts)


def _role_known(t: _Template, role: Any) -> bool:
    if not isinstance(role, str):
        return False
    if role in ROLES:
        return True
    known = t.roles.get(role)
    if known is None:  # ipython (Llama 3.1), function, ...: allowed where the template names them
        known = t.roles[role] = f"'{role}'" in t.source or f'"{role}"' in t.source
    return known


def normalise(t: _Template, messages: list[dict]) -> list[dict]:
    """`messages` as the template should see them: text parts joined, None content dropped; checked."""
    out = messages
    for j, m in enumerate(messages):
        role = m.get("role")
        if not _role_known(t, role):
            msg = (
                f"message {j} has role {role!r}, which the chat template does not name; use one of "
                f"{', '.join(ROLES)} (or a role the template names, like Llama 3.1's 'ipython')"
            )
            raise ConfigError(msg)
        content = m.get("content")
        if isinstance(content, str):
            continue
        if isinstance(content, list):
            new = {**m, "content": _text_of(content, j)}
        elif content is None and role == "assistant" and m.get("tool_calls"):
            # apply_chat_template drops None values too: templates test `content is defined`
            new = {k: v for k, v in m.items() if k != "content"}
        elif content is None:
            msg = (
                f"message {j} ({role}) has no content; give it a string (content may be absent or None "
                "only on an assistant turn that has 'tool_calls')"
            )
            raise ConfigError(msg)
        else:
            msg = (
                f"message {j} ({role}) has content of type {type(content).__name__} ({content!r}); give a "
                "string or a list of {'type': 'text', 'text': ...} parts (for a number, write it as text)"
            )
            raise ConfigError(msg)
        if out is messages:
            out = list(messages)
        out[j] = new
    return out


# ------------------------------------------------------------------------------------- trained spans
def _anchor(m: dict) -> str:
    """Text of an assistant turn that the rendering keeps: the answer after any reasoning, or a tool name."""
    content = m.get("content") or ""
    if "</think>" in content:
        content = content.split("</think>")[-1]
    anchor = content.strip()
    if not anchor:
        for call in m.get("tool_calls") or []:
            fn = call.get("function", call) if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                return fn["name"]
    return anchor


def _lost(j: int) -> ConfigError:
    msg = (
        f"assistant message {j} cannot be found in the rendered conversation (the chat template drops "
        "or rewrites its text); check what the template renders for it, or convert the row to "
        "prompt/completion strings"
    )
    return ConfigError(msg)


def _turn_spans(
    t: _Template, text: str, messages: list[dict], first: int = 0
) -> list[tuple[int, int]]:
    """Each assistant turn (from message `first` on), from after its header through its end-of-turn."""
    spans: list[tuple[int, int]] = []
    cursor = 0
    for j, m in enumerate(messages):
        if m.get("role") != "assistant":
            if not t.header and m.get("role") == "user" and isinstance(m.get("content"), str):
                # no header to find turns by: step over the user's text, so an answer is not found
                # in text before it (Mistral's default system prompt says "Paris.")
                said = m["content"].strip()
                at = text.find(said, cursor) if said else -1
                cursor = at + len(said) if at >= 0 else cursor
            continue
        anchor = _anchor(m)
        if not anchor:
            msg = (
                f"assistant message {j} is empty, so the row has nothing to train on there; give it "
                "content (or tool_calls), or drop the turn"
            )
            raise ConfigError(msg)
        if t.header:
            p = text.find(t.header, cursor)
            if p < 0:
                raise _lost(j)
            start = p + len(t.header)
            a = text.find(anchor, start)
            nxt = text.find(t.header, start)
            if a < 0 or (nxt >= 0 and a > nxt):
                raise _lost(j)
        else:  # no header (Mistral's "[/INST]" ends the user turn): the turn starts at its text
            whole = (m.get("content") or "").strip()
            a = text.find(whole, cursor) if whole else -1
            if a >= 0:
                anchor = whole
            else:
                a = text.find(anchor, cursor)
                if a < 0:
                    raise _lost(j)
            start = a
        while start < a and text[start].isspace():
            start += 1
        end = a + len(anchor)
        if t.eot:
            e = text.find(t.eot, end)
            nxt = text.find(t.header, end) if t.header else -1
            if e >= 0 and (nxt < 0 or e < nxt):
                end = e + len(t.eot)
        if j >= first:
            spans.append((start, end))
        cursor = end
    return spans


# ------------------------------------------------------------------------------------------ the rows
def conversation(
    tokenizer: Any, messages: list[dict], tools: Any = None, kwargs: dict | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """A `messages` row: its rendered text, and the character spans of its assistant turns."""
    check_template(tokenizer)
    t = _template(tokenizer, tools, kwargs)
    messages = normalise(t, messages)
    text, marked = _render(t, messages, tools=tools, kwargs=kwargs)
    if t.generation:
        spans = [(a, b) for a, b in marked if b > a and text[a:b].strip()]
        if not spans:
            msg = (
                "the chat template's {% generation %} blocks are empty for this row, so it has nothing to "
                "train on; give the assistant turns content"
            )
            raise ConfigError(msg)
        return text, spans
    return text, _turn_spans(t, text, messages)


def prompt_completion(
    tokenizer: Any,
    prompt: list[dict],
    completion: list[dict],
    tools: Any = None,
    kwargs: dict | None = None,
) -> tuple[str, list[tuple[int, int]]]:
    """A conversational prompt/completion row: the loss covers all the completion renders, as in TRL."""
    check_template(tokenizer)
    t = _template(tokenizer, tools, kwargs)
    prompt, completion = normalise(t, prompt), normalise(t, completion)
    head, _ = _render(t, prompt, generation_prompt=True, tools=tools, kwargs=kwargs)
    full, _ = _render(t, prompt + completion, tools=tools, kwargs=kwargs)
    if full.startswith(head) and len(full) > len(head):
        return full, [(len(head), len(full))]
    # a template that renders the prompt differently once answered: train the completion's turns
    if t.generation:
        _, marked = _render(t, prompt + completion, tools=tools, kwargs=kwargs)
        spans = [(a, b) for a, b in marked if a >= len(os.path.commonprefix([head, full]))]
    else:
        spans = _turn_spans(t, full, prompt + completion, first=len(prompt))
    if not spans:
        msg = "the completion renders empty, so the row has nothing to train on; give it content"
        raise ConfigError(msg)
    return full, spans


def generation_prompt(
    tokenizer: Any, messages: list[dict], tools: Any = None, kwargs: dict | None = None
) -> str:
    """A chat prompt to generate from: the messages rendered with the template's generation prompt
    (what `prompt_completion` renders as a row's prompt, so generation sees what training saw)."""
    check_template(tokenizer)
    t = _template(tokenizer, tools, kwargs)
    text, _ = _render(t, normalise(t, messages), generation_prompt=True, tools=tools, kwargs=kwargs)
    return text
