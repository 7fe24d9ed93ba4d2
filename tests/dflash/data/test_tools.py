"""A conversation's top-level `tools` reach the chat template wherever it is rendered (training tokens,
regeneration prompts, the server request), so the drafter sees the tools block the target sees when it is
served with tools. Checked with the Qwen3-style template of tests/data/templates and the Qwen3.5-style
one of chat_templates."""

from __future__ import annotations

import json

import pytest

from dflash.data.chat import Conversation, load_chat_jsonl, parse_conversation, prompt_ids, tools_of, write_jsonl
from dflash.data.spans import tokenize_conversation
from tests.dflash.data.test_spans import TOOL_TURNS, marked, tokenizer_for

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TEMPLATES = ["think_after_last_query", "think_in_prompt"]  # Qwen3-style, Qwen3.5-style


def with_tools(messages) -> Conversation:
    return parse_conversation({"messages": messages, "tools": [WEATHER_TOOL]})


@pytest.mark.parametrize("template", TEMPLATES)
def test_the_tools_block_is_context_and_the_turns_are_supervised_as_without_it(template):
    conv = with_tools(TOOL_TURNS)
    tok = tokenizer_for(template, conv, TOOL_TURNS)
    with_block, without = marked(tok, conv), marked(tok, TOOL_TURNS)
    # The render with tools is the tools system turn followed by the render without: the block is never
    # supervised, and the tool call turn (supervised) and the tool responses (not) are as before.
    assert with_block.endswith(without) and with_block != without
    block = with_block[:-len(without)]
    assert "⟦" not in block and "Tools" in block
    assert '"get_weather",' in block and block.startswith("<|im_start|> system")
    supervised = " ".join(part.split("⟧")[0] for part in with_block.split("⟦")[1:])
    assert "<tool_call>" in supervised and "get_weather" in supervised  # the call: supervised
    assert "<tool_response>" not in supervised and "21}" not in supervised  # the tool's answer: context
    ids, _ = tokenize_conversation(tok, conv, max_length=4096)
    assert "get_weather" in tok.decode(ids[:40])


@pytest.mark.parametrize("template", TEMPLATES)
def test_the_prompt_the_target_answers_holds_the_tools_block(template):
    conv = with_tools(TOOL_TURNS[:1])
    tok = tokenizer_for(template, conv)
    text = tok.decode(prompt_ids(tok, conv))
    assert "Tools" in text and "get_weather" in text and text.rstrip().endswith(("assistant", "<think>"))
    assert "get_weather" not in tok.decode(prompt_ids(tok, TOOL_TURNS[:1]))


def test_tools_are_read_from_a_record_and_written_back(tmp_path):
    path = tmp_path / "chat.jsonl"
    rows = [{"messages": TOOL_TURNS, "tools": [WEATHER_TOOL]},
            {"messages": TOOL_TURNS, "tools": json.dumps([WEATHER_TOOL])},  # datasets often store a JSON string
            {"messages": TOOL_TURNS}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    conversations, report = load_chat_jsonl(path, on_error="stop")
    assert [tools_of(c) for c in conversations] == [[WEATHER_TOOL], [WEATHER_TOOL], None]
    write_jsonl(tmp_path / "out.jsonl", conversations)
    written = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [w.get("tools") for w in written] == [[WEATHER_TOOL], [WEATHER_TOOL], None]


def test_arrow_nulls_in_tools_are_dropped_and_bad_tools_named():
    arrow = dict(WEATHER_TOOL, function=dict(WEATHER_TOOL["function"], strict=None))
    assert tools_of(parse_conversation({"messages": TOOL_TURNS, "tools": [arrow]})) == [WEATHER_TOOL]
    with pytest.raises(ValueError, match="tools must be a list of tool schemas"):
        parse_conversation({"messages": TOOL_TURNS, "tools": {"name": "x"}})
    with pytest.raises(ValueError, match="tools is a string but not JSON"):
        parse_conversation({"messages": TOOL_TURNS, "tools": "[{"})


def test_regeneration_histories_and_server_requests_carry_the_tools(monkeypatch):
    from dflash.regenerate import local
    from dflash.regenerate.client import ChatClient
    from dflash.regenerate.server import answer_conversation

    seen = []

    def fake_generate(model, tokenizer, histories, max_new_tokens, **kwargs):
        seen.extend(histories)
        return ["ok"] * len(histories), 0

    monkeypatch.setattr(local, "generate_replies", fake_generate)
    conv = with_tools(TOOL_TURNS)
    target = type("T", (), {"model": None, "tokenizer": None})()
    out = local.regenerate(target, [conv], max_new_tokens=4, progress=False)
    assert seen and all(tools_of(h) == [WEATHER_TOOL] for h in seen) and tools_of(out[0]) == [WEATHER_TOOL]

    client = ChatClient(url="http://127.0.0.1:9/v1/chat/completions", model="m", max_tokens=8)
    assert json.loads(client.body(conv))["tools"] == [WEATHER_TOOL]
    assert "tools" not in json.loads(client.body(list(conv)))

    class Recording:
        def complete(self, messages):
            seen.append(messages)
            return type("Reply", (), {"content": "ok", "reasoning": None, "cut": 0})(), 1

    seen.clear()
    result, _, _ = answer_conversation(Recording(), conv)
    assert seen and all(tools_of(m) == [WEATHER_TOOL] for m in seen) and tools_of(result) == [WEATHER_TOOL]
