"""Chat conversations on disk and as prompts: JSONL in and out, and the token ids of a prompt.

    {"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}]}   one per line
    --load_chat_jsonl--> conversations [[{"role", "content"}, ...], ...] + a DataReport of what was skipped
    --write_jsonl--> the same format back (written atomically)

ShareGPT's {"conversations": [{"from", "value"}]} and OpenAI-style text parts are read too, and so
are the fields chat templates render besides the text: an assistant's reasoning (`reasoning_content`,
or vLLM's `reasoning` / `thinking`, stored as `reasoning_content`) and `tool_calls` (their `arguments`
parsed from a JSON string into a mapping, as Qwen3.5's template needs), and `tool` messages (with
`name` / `tool_call_id`). A conversation may end with a user prompt and no answer: `dflash.regenerate`
fills it in.

A record's top-level `tools` (the OpenAI function schemas the target was served with) stay with its
messages: a parsed conversation is a `Conversation`, a list of messages with a `tools` attribute, and
every render passes them to the chat template, which lays them out as the system block the target saw
({"messages": [...], "tools": [...]} in the JSONL, written back the same way).

Turns must come in the order a chat has them: system messages first, then a user message; never two
user or two assistant messages in a row; a tool result only after an assistant message or another tool
result. A conversation out of that order is a bad record (reason "roles_out_of_order": counted and
skipped, or fatal with --on-bad-line stop), not trained on as if it were a chat.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from common.fsutil import atomic_write

from dflash.errors import DataError

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
# ShareGPT spells roles differently; these are the spellings seen in the wild.
_ROLE_ALIASES = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant"}
_MESSAGE_KEYS = ("messages", "conversations", "conversation")
# Where servers and datasets put an assistant's reasoning (vLLM >= 0.11: reasoning; SGLang: reasoning_content).
_REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
# Bump when what parse_conversation accepts changes: it is part of the token cache's key (dflash.data.token_cache).
CONVERSATION_RULES_VERSION = 2  # 2: roles out of order are refused


class OutOfOrder(ValueError):
    """A conversation whose roles are not in a chat's order; `reason` is the DataReport's key."""

    reason = "roles_out_of_order"


def bad_record_reason(exc: ValueError) -> str:
    """The DataReport key of a record that parse_conversation (or json, or UTF-8 decoding) refused."""
    if isinstance(exc, UnicodeDecodeError):
        return "not_utf8"
    if isinstance(exc, json.JSONDecodeError):
        return "bad_json"
    return getattr(exc, "reason", "bad_conversation")


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


def _tool_calls(calls) -> list[dict]:
    """OpenAI-style tool calls, each {"type": "function", "function": {"name", "arguments": mapping}}."""
    if not isinstance(calls, list):
        raise ValueError(f"tool_calls must be a list, got {type(calls).__name__}")
    out = []
    for j, call in enumerate(calls, start=1):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tool call {j} has no function name")
        args = fn.get("arguments", {})
        if isinstance(args, str):  # servers return a JSON string; templates iterate a mapping
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as exc:
                raise ValueError(f"tool call {j} ({fn['name']}): arguments are not JSON: {exc}") from None
        if isinstance(args, dict):  # Arrow gives every struct the union of all rows' keys, missing ones null
            args = {k: v for k, v in args.items() if v is not None}
        out.append({"type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def _message(i: int, message) -> dict:
    if not isinstance(message, dict):
        raise ValueError(f"message {i} is a {type(message).__name__}, not an object")
    role = message.get("role", message.get("from"))
    role = _ROLE_ALIASES.get(role, role)
    if role not in ROLES:
        raise ValueError(f"message {i} has role {role!r}; supported roles: {', '.join(ROLES)}")
    content = message.get("content", message.get("value"))
    calls = message.get("tool_calls") if role == "assistant" else None
    try:
        out = {"role": role, "content": "" if content is None and calls else _message_text(content)}
        if calls:
            out["tool_calls"] = _tool_calls(calls)
    except ValueError as exc:
        raise ValueError(f"message {i}: {exc}") from None
    if role == "assistant":
        reasoning = next((message[k] for k in _REASONING_KEYS if message.get(k) is not None), None)
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise ValueError(f"message {i}: reasoning must be a string, got {type(reasoning).__name__}")
            out["reasoning_content"] = reasoning
    if role == "tool":
        out.update({k: str(message[k]) for k in ("name", "tool_call_id") if message.get(k) is not None})
    return out


class Conversation(list):
    """A conversation's messages, plus the tools it was served with (`tools`: a list of function schemas,
    or None). A slice or copy is a plain list: keep the tools with `Conversation(part, tools_of(whole))`."""

    def __init__(self, messages=(), tools=None):
        super().__init__(messages)
        self.tools = tools or None


def tools_of(messages) -> list[dict] | None:
    """The tools a conversation (or a history built with them) was served with, or None."""
    return getattr(messages, "tools", None)


def _without_nulls(value):
    """Arrow gives every struct the union of all rows' keys, the missing ones null: drop them."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _tools(value) -> list[dict] | None:
    """A record's `tools`: a list of schema objects, or its JSON string (datasets often store it so)."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError as exc:
            raise ValueError(f"tools is a string but not JSON: {exc}") from None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise ValueError(f"tools must be a list of tool schemas (objects), got {type(value).__name__}")
    return _without_nulls(value) or None


def parse_conversation(record) -> list[dict]:
    """One JSONL record -> [{"role", "content", ...}, ...]; raises ValueError saying what is wrong.

    Accepts {"messages": [...]}, {"conversations": [...]} (also ShareGPT's from/value) or a bare list.
    Besides role and content a message keeps reasoning_content and tool_calls (assistant) and name and
    tool_call_id (tool); a None field counts as absent (Parquet and Arrow fill missing fields with null).
    A record's `tools` become the Conversation's `tools`.
    """
    tools = None
    if isinstance(record, dict):
        key = next((k for k in _MESSAGE_KEYS if k in record), None)
        if key is None:
            raise ValueError(f'no "messages" list (keys: {sorted(record)[:8]})')
        tools = _tools(record.get("tools"))
        record = record[key]
    if not isinstance(record, list) or not record:
        raise ValueError("the conversation must be a non-empty list of messages")
    messages = [_message(i, message) for i, message in enumerate(record, start=1)]
    check_turn_order(messages)
    if not any(m["role"] == "assistant" and (m["content"] or m.get("tool_calls")) for m in messages):
        if messages[-1]["role"] not in ("user", "tool"):
            raise ValueError("no assistant message and no final user prompt to answer")
    return Conversation(messages, tools)


def check_turn_order(messages: list[dict]) -> None:
    """Raise OutOfOrder naming the first message out of a chat's order (see the module docstring)."""
    roles = [m["role"] for m in messages]
    first = next((i for i, role in enumerate(roles) if role != "system"), None)
    if first is None:
        return
    if roles[first] != "user":
        raise OutOfOrder(f"roles out of order: message {first + 1} is {roles[first]!r}, but a conversation starts "
                         "with a user message (after any system message); add the user prompt it answers, or "
                         "drop the conversation")
    for i in range(first + 1, len(roles)):
        role, before = roles[i], roles[i - 1]
        if role == "system":
            raise OutOfOrder(f"roles out of order: message {i + 1} is a system message after the conversation "
                             "began; system messages go first")
        if role in ("user", "assistant") and role == before:
            raise OutOfOrder(f"roles out of order: messages {i} and {i + 1} are both {role!r}; merge them into one "
                             f"message, or put the {'assistant' if role == 'user' else 'user'}'s turn between them")
        if role == "tool" and before not in ("assistant", "tool"):
            raise OutOfOrder(f"roles out of order: message {i + 1} is a tool result after a {before!r} message; a "
                             "tool result follows the assistant message that called the tool")


def chat_lines(path, report: DataReport, on_error: str = "skip") -> Iterator[tuple[int, object, list[dict]]]:
    """(line number, JSON record, messages) of each good conversation in a chat JSONL file, counted in `report`
    (the skipped lines are logged once the file is read).

    Blank lines are ignored, a UTF-8 BOM on the first line is dropped. on_error="stop": the first bad line raises
    DataError naming the file and line number; on_error="skip": bad lines are counted in the report (reason
    "bad_json" or "bad_conversation") and left out.
    """
    if on_error not in ("skip", "stop"):
        raise ValueError(f"on_error must be 'skip' or 'stop', got {on_error!r}")
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file; pass a JSONL file with one conversation per line")
    with path.open("rb") as lines:
        for lineno, raw in enumerate(lines, start=1):
            if lineno == 1:  # a UTF-8 BOM (Windows editors) is not part of the first conversation
                raw = raw.removeprefix(b"\xef\xbb\xbf")
            if not raw.strip():
                continue
            report.n_read += 1
            try:
                record = json.loads(raw.decode("utf-8"))
                messages = parse_conversation(record)
            except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                detail = f"{path}:{lineno}: {exc}"
                if on_error == "stop":
                    raise DataError(f"{detail}; fix or delete that line, or skip bad lines (--on-bad-line skip, "
                                    "on_error='skip')") from None
                report.skip(bad_record_reason(exc), detail)
                continue
            report.n_kept += 1
            yield lineno, record, messages
    if report.n_skipped:
        log.warning("%s; first problems: %s", report.summary(), "; ".join(report.examples))


def load_chat_jsonl(path, on_error: str = "skip") -> tuple[list[list[dict]], DataReport]:
    """Read chat conversations from a JSONL file (one conversation per line; bad lines as `chat_lines` treats them).

    A conversation may end with a user prompt and no answer: `regenerate` fills it in.
    """
    report = DataReport(source=str(path))
    conversations = [messages for _, _, messages in chat_lines(path, report, on_error)]
    if report.n_read == 0:
        raise DataError(f"{path} is empty (no conversation on any line); pass a JSONL file with one "
                        '{"messages": [...]} conversation per line')
    return conversations, report


def jsonl_record(messages: list[dict]) -> dict:
    """The JSONL record of a conversation: {"messages": [...]}, plus "tools" when it has them."""
    tools = tools_of(messages)
    return {"messages": list(messages), **({"tools": tools} if tools else {})}


def write_jsonl(path, conversations: list[list[dict]]) -> None:
    """Write conversations as chat JSONL ({"messages": [...][, "tools": [...]]} per line), atomically."""
    text = "".join(json.dumps(jsonl_record(c), ensure_ascii=False) + "\n" for c in conversations)
    atomic_write(Path(path), text)


# --------------------------------------------------------------------------------------------------
# Rendering with the chat template
# --------------------------------------------------------------------------------------------------
def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The conversation as the tokenizer's chat template lays it out (text, not token ids), with its tools."""
    return tokenizer.apply_chat_template(list(messages), tools=tools_of(messages), tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the conversation up to (not including) its first assistant turn, plus the
    generation prompt: what the target sees before it starts answering."""
    head = Conversation(tools=tools_of(messages))
    for m in messages:
        if m["role"] == "assistant":
            break
        head.append(m)
    return list(tokenizer(render(tokenizer, head, add_generation_prompt=True), add_special_tokens=False)["input_ids"])
