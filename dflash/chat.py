"""Chat conversations on disk and as prompts: JSONL in and out, and the token ids of a prompt.

    {"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}]}   one per line
    --load_chat_jsonl--> conversations [[{"role", "content"}, ...], ...] + a DataReport of what was skipped
    --write_jsonl--> the same format back (written atomically)

ShareGPT's {"conversations": [{"from", "value"}]} and OpenAI-style text parts are read too. A
conversation may end with a user prompt and no answer: `dflash.regenerate` fills it in.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from wheelbuilder.fsutil import atomic_write

from .errors import DataError

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
# ShareGPT spells roles differently; these are the spellings seen in the wild.
_ROLE_ALIASES = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant"}
_MESSAGE_KEYS = ("messages", "conversations", "conversation")


@dataclass
class DataReport:
    """What happened to each record: how many were read, kept, and skipped for which reason."""

    source: str
    n_read: int = 0
    n_kept: int = 0
    skipped: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)  # the first few skip messages, for the log
    max_examples: int = 5

    def skip(self, reason: str, detail: str) -> None:
        self.skipped[reason] += 1
        if len(self.examples) < self.max_examples:
            self.examples.append(detail)

    @property
    def n_skipped(self) -> int:
        return sum(self.skipped.values())

    def summary(self) -> str:
        reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(self.skipped.items())) or "none"
        return f"{self.source}: read {self.n_read}, kept {self.n_kept}, skipped {self.n_skipped} ({reasons})"

    __str__ = summary

    def to_dict(self) -> dict:
        return {"source": self.source, "n_read": self.n_read, "n_kept": self.n_kept,
                "skipped": dict(self.skipped), "examples": list(self.examples)}



# --------------------------------------------------------------------------------------------------
# JSONL
# --------------------------------------------------------------------------------------------------
def _message_text(content) -> str:
    """A message's text: a string, or OpenAI-style parts [{"type": "text", "text": ...}, ...]."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise ValueError(f"content must be a string or a list of text parts, got {type(content).__name__}")


def parse_conversation(record) -> list[dict]:
    """One JSONL record -> [{"role", "content"}, ...]; raises ValueError saying what is wrong.

    Accepts {"messages": [...]}, {"conversations": [...]} (also ShareGPT's from/value) or a bare list.
    """
    if isinstance(record, dict):
        key = next((k for k in _MESSAGE_KEYS if k in record), None)
        if key is None:
            raise ValueError(f'no "messages" list (keys: {sorted(record)[:8]})')
        record = record[key]
    if not isinstance(record, list) or not record:
        raise ValueError("the conversation must be a non-empty list of messages")
    messages = []
    for i, message in enumerate(record, start=1):
        if not isinstance(message, dict):
            raise ValueError(f"message {i} is a {type(message).__name__}, not an object")
        role = message.get("role", message.get("from"))
        role = _ROLE_ALIASES.get(role, role)
        if role not in ROLES:
            raise ValueError(f"message {i} has role {role!r}; supported roles: {', '.join(ROLES)}")
        try:
            content = _message_text(message.get("content", message.get("value")))
        except ValueError as exc:
            raise ValueError(f"message {i}: {exc}") from None
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" and m["content"] for m in messages):
        if messages[-1]["role"] != "user":
            raise ValueError("no assistant message and no final user prompt to answer")
    return messages


def load_chat_jsonl(path, on_error: str = "skip") -> tuple[list[list[dict]], DataReport]:
    """Read chat conversations from a JSONL file (one conversation per line; blank lines ignored).

    on_error="stop": the first bad line raises DataError naming the file and line number.
    on_error="skip": bad lines are counted in the report (reason "bad_json" or "bad_conversation").
    A conversation may end with a user prompt and no answer: `regenerate` fills it in.
    """
    if on_error not in ("skip", "stop"):
        raise ValueError(f"on_error must be 'skip' or 'stop', got {on_error!r}")
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file; pass a JSONL file with one conversation per line")
    report = DataReport(source=str(path))
    conversations = []
    with path.open("rb") as lines:
        for lineno, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            report.n_read += 1
            try:
                conversations.append(parse_conversation(json.loads(raw.decode("utf-8"))))
                report.n_kept += 1
            except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                reason = ("not_utf8" if isinstance(exc, UnicodeDecodeError) else
                          "bad_json" if isinstance(exc, json.JSONDecodeError) else "bad_conversation")
                detail = f"{path}:{lineno}: {exc}"
                if on_error == "stop":
                    raise DataError(f"{detail}; fix or delete that line, or load with on_error='skip'") from None
                report.skip(reason, detail)
    if report.n_skipped:
        log.warning("%s; first problems: %s", report.summary(), "; ".join(report.examples))
    return conversations, report



def write_jsonl(path, conversations: list[list[dict]]) -> None:
    """Write conversations as chat JSONL ({"messages": [...]} per line), atomically."""
    text = "".join(json.dumps({"messages": c}, ensure_ascii=False) + "\n" for c in conversations)
    atomic_write(Path(path), text)


# --------------------------------------------------------------------------------------------------
# Rendering with the chat template
# --------------------------------------------------------------------------------------------------
def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The conversation as the tokenizer's chat template lays it out (text, not token ids)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the conversation up to (not including) its first assistant turn, plus the
    generation prompt: what the target sees before it starts answering."""
    head = []
    for m in messages:
        if m["role"] == "assistant":
            break
        head.append(m)
    return list(tokenizer(render(tokenizer, head, add_generation_prompt=True), add_special_tokens=False)["input_ids"])
