"""Assistant spans: which tokens of a rendered conversation the drafter learns to predict.

The loss mask is 1 exactly on what the target generates for each assistant turn, located in the
single full render of the conversation (never by rendering prefixes: Qwen3's and Qwen3.5's templates
render an earlier assistant turn differently from the last one, so a prefix render is not a prefix of
the full render).

Two ways to locate the turns, chosen by the template:

1. Templates with `{% generation %}` markers: transformers' `return_assistant_tokens_mask` (the
   template author says which text is the answer; a token overlapping a marked block counts).
2. Any other template: the assistant header is derived from the template itself, as the text that
   `add_generation_prompt=True` appends to a render of the messages before the turn
   (e.g. "<|im_start|>assistant\\n", or Qwen3.5's "<|im_start|>assistant\\n<think>\\n"), and the
   end-of-turn marker as what the template writes after an assistant's content, trailing whitespace
   removed (e.g. "<|im_end|>"). The full render is then walked turn by turn, in order: each turn
   starts at its header and runs to its end marker. What is supervised is everything after the
   generation prompt up to and including the end marker, not the newline after it:

       <|im_start|>user\\nWhat is 2+2?<|im_end|>\\n
       <|im_start|>assistant\\n[4<|im_end|>]\\n                  earlier turn: reasoning stripped by
       <|im_start|>user\\nAnd 3+3?<|im_end|>\\n                  the template; its answer + end token
       <|im_start|>assistant\\n<think>\\n[Add again.\\n</think>\\n\\n6<|im_end|>]\\n
                                    ^ Qwen3.5: "<think>\\n" is part of the generation prompt

   When a turn renders with only the first line of the header (Qwen3.5's turns before the last user
   query render "<|im_start|>assistant\\n" + answer, reasoning stripped), the span starts after that
   line: the rendered answer and its end token are supervised. For Qwen3 the header is
   "<|im_start|>assistant\\n", so a turn's "<think>...</think>" block, when rendered, is supervised.

A token that straddles the prompt/answer boundary (Qwen's "\\n\\n" token in "<think>\\n\\n</think>"
when "<think>\\n" is the prompt) is not supervised: only tokens whose characters lie wholly inside a
span are. A template whose generation prompt adds nothing, or whose turns cannot be found by that
header and end marker, raises ChatTemplateError naming the template; a conversation the template
rejects, or with no assistant turn, or with an assistant turn that renders empty, raises Unusable
with the reason the DataReport counts.
"""

from __future__ import annotations

import bisect
import hashlib
import re

from dflash.data.chat import Conversation, tools_of
from dflash.errors import ChatTemplateError, DataError

# Bump when what gets supervised changes: it is part of the token cache's key (dflash.data.token_cache).
# 3: a conversation's tools are rendered (the tools system block is context, never supervised).
SPAN_RULES_VERSION = 3

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_SENTINEL = "DFLASHSPANSENTINEL"
_THINK_TAGS = re.compile(r"</?think>")


class Unusable(ValueError):
    """A conversation that cannot give a training sample; `reason` is the DataReport's key."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def template_of(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one renders chats
        template = template.get("default")
    if not template:
        raise ChatTemplateError(f"the tokenizer of {template_name(tokenizer)} has no chat template; "
                                "set tokenizer.chat_template (or use a target whose tokenizer has one)")
    return template


def template_name(tokenizer) -> str:
    """How errors name a tokenizer's template: its model path plus the template's short sha256."""
    where = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        return f"{where} (chat template sha256 {hashlib.sha256(template.encode()).hexdigest()[:12]})"
    return where


def has_generation_markers(tokenizer) -> bool:
    return bool(_GENERATION_TAG.search(template_of(tokenizer)))


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    if not messages and not add_generation_prompt:
        return ""
    try:
        return tokenizer.apply_chat_template(list(messages), tools=tools_of(messages), tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # jinja raises TemplateError, TypeError, UndefinedError, ... for what it rejects
        raise Unusable("template_error", f"the chat template rejects the conversation: "
                                         f"{type(exc).__name__}: {exc}") from None


def turn_markers(tokenizer, head: list[dict]) -> tuple[str, str]:
    """(generation header, end-of-turn marker) for an assistant turn that follows `head`."""
    plain = _render(tokenizer, head)
    prompted = _render(tokenizer, head, add_generation_prompt=True)
    if not prompted.startswith(plain) or prompted == plain:
        raise ChatTemplateError(
            f"the chat template of {template_name(tokenizer)} adds no generation prompt after the messages "
            f"before an assistant turn (add_generation_prompt=True renders {prompted[-60:]!r}), so its assistant "
            "turns cannot be located; use a template with a generation prompt or with {% generation %} markers")
    header = prompted[len(plain):]
    probe = _render(tokenizer, Conversation([*head, {"role": "assistant", "content": _SENTINEL}], tools_of(head)))
    if _SENTINEL not in probe:
        raise ChatTemplateError(f"the chat template of {template_name(tokenizer)} does not render an assistant "
                                "message's content; its assistant turns cannot be located")
    end = probe[probe.rindex(_SENTINEL) + len(_SENTINEL):].rstrip()
    if not end:
        raise ChatTemplateError(
            f"the chat template of {template_name(tokenizer)} writes no end-of-turn marker after an assistant "
            "message, so neither where an answer ends nor its stop token can be supervised; use a template that "
            "ends turns with a token (e.g. <|im_end|>) or one with {% generation %} markers")
    return header, end


def _first_line(header: str) -> str:
    """The role line of a header ("<|im_start|>assistant\\n" of "<|im_start|>assistant\\n<think>\\n")."""
    cut = header.find("\n")
    return header[:cut + 1] if 0 <= cut < len(header) - 1 else header


def assistant_char_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The full render and the [start, end) character span of each assistant turn's generated part.

    Walks the full render in order (see the module docstring); one span per assistant message.
    """
    full = _render(tokenizer, messages)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        header, end = turn_markers(tokenizer, Conversation(messages[:k], tools_of(messages)))
        role_line = _first_line(header)
        at_role = full.find(role_line, cursor)
        if at_role < 0:
            raise ChatTemplateError(
                f"assistant message {k + 1}: its header {header!r} (the template's generation prompt) is not in "
                f"the rendered conversation after character {cursor}, so the chat template of "
                f"{template_name(tokenizer)} gives no way to locate its assistant turns; use a template whose "
                "assistant turns start with its generation prompt, or one with {% generation %} markers")
        start = at_role + (len(header) if full.startswith(header, at_role) else len(role_line))
        stop = full.find(end, start)
        if stop < 0:
            raise ChatTemplateError(
                f"assistant message {k + 1}: no end-of-turn marker {end!r} after its header in the render, so the "
                f"chat template of {template_name(tokenizer)} gives no way to locate where the turn ends")
        body = _THINK_TAGS.sub("", full[start:stop]).strip()
        if not body:
            raise Unusable("empty_assistant_turn", f"assistant message {k + 1} renders empty "
                                                   f"({full[at_role:stop + len(end)]!r})")
        spans.append((start, stop + len(end)))
        cursor = stop + len(end)
    return full, spans


def _mask_inside(offsets, spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose [s, e) characters lie wholly inside one span (a straddling token: 0)."""
    starts = [s for s, _ in spans]
    mask = []
    for s, e in offsets:
        i = bisect.bisect_right(starts, s) - 1
        mask.append(int(i >= 0 and e <= spans[i][1] and e > s))
    return mask


def _check_marked_turns(tokenizer, ids: list[int], mask: list[int], n_assistant: int) -> None:
    """Each {% generation %} block must hold text besides special tokens and think tags."""
    runs, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append(ids[start:i])
            start = None
    if len(runs) < n_assistant:
        raise Unusable("empty_assistant_turn", f"{n_assistant} assistant messages, but only {len(runs)} render "
                                               "text inside the template's {% generation %} blocks")
    for n, run in enumerate(runs, start=1):
        if not _THINK_TAGS.sub("", tokenizer.decode(run, skip_special_tokens=True)).strip():
            raise Unusable("empty_assistant_turn", f"assistant turn {n} renders empty "
                                                   f"({tokenizer.decode(run)!r})")


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int) -> tuple[list[int], list[int]]:
    """Chat-template token ids and a loss mask that is 1 exactly on the generated part of each assistant
    turn; both truncated to `max_length`. Needs a fast tokenizer (offset mappings)."""
    if max_length < 2:
        raise ValueError(f"max_length={max_length} is too short; use at least a few hundred tokens")
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(f"{type(tokenizer).__name__} is not a fast tokenizer; load it with use_fast=True "
                        "(offset mappings are needed to find the assistant tokens)")
    n_assistant = sum(m["role"] == "assistant" for m in messages)
    if not n_assistant:
        raise Unusable("no_assistant_turn", "the conversation has no assistant message to learn from")
    if has_generation_markers(tokenizer):
        try:
            out = tokenizer.apply_chat_template(list(messages), tools=tools_of(messages), tokenize=True,
                                                return_dict=True, return_assistant_tokens_mask=True)
        except Exception as exc:
            raise Unusable("template_error", f"the chat template rejects the conversation: "
                                             f"{type(exc).__name__}: {exc}") from None
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        _check_marked_turns(tokenizer, ids, mask, n_assistant)
        return ids[:max_length], mask[:max_length]
    text, spans = assistant_char_spans(tokenizer, messages)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = _mask_inside(encoded["offset_mapping"][:max_length], spans)
    return list(encoded["input_ids"][:max_length]), mask
