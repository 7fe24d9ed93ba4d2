"""dflash.spans: assistant spans located in the single full render, for templates that render earlier
turns differently (tests/data/templates/*.jinja, and chat_templates/think_in_prompt.jinja, which bench_data
renders too), each checked token by token against a hand-written mask.

The expected masks below are written as the token sequence, one token per space, with the supervised
tokens between ⟦ and ⟧; `\\n` is a newline token and `\\n\\n` the single token of two newlines (as in
Qwen's vocabularies, where newline runs merge)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash.errors import ChatTemplateError
from dflash.data.chat import Conversation, render, tools_of
from dflash.data.spans import Unusable, assistant_char_spans, tokenize_conversation

REPO = Path(__file__).resolve().parents[3]
TEMPLATES = {p.stem: p for d in (REPO / "tests" / "data" / "templates", REPO / "chat_templates")
             for p in sorted(d.glob("*.jinja"))}
SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
            "<tool_response>", "</tool_response>"]


def chat_tokenizer(template: str, texts: list[str]):
    """A word-level fast tokenizer: the specials, newline runs as one token each, words split at spaces."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex("\n+"), "isolated"),
                                                  pre_tokenizers.Split(Regex(" +"), "removed")])
    plain = []
    for text in texts:
        for special in SPECIALS:
            text = text.replace(special, " ")
        plain.append(text)
    core.train_from_iterator(plain, trainers.WordLevelTrainer(special_tokens=["<unk>"] + SPECIALS))
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>",
                                   eos_token="<|im_end|>", additional_special_tokens=SPECIALS[1:],
                                   chat_template=TEMPLATES[template].read_text())


def tokenizer_for(template: str, *conversations):
    """The template's tokenizer with a vocabulary covering these conversations' renders."""
    words = "user assistant system What is 2+2? And 3+3? 4 6 Add them. again. You are terse. Hello"
    tok = chat_tokenizer(template, [words])
    texts = [render(tok, c) for c in conversations]  # with the conversation's tools, if it has any
    for c in conversations:
        for k in range(1, len(c)):
            try:
                texts.append(render(tok, Conversation(c[:k], tools_of(c)), add_generation_prompt=True))
            except Exception:  # a prefix this template rejects (no user query yet)
                pass
    return chat_tokenizer(template, [words, *texts])


def marked(tokenizer, messages) -> str:
    """The conversation's tokens in the notation of the expected masks."""
    ids, mask = tokenize_conversation(tokenizer, messages, max_length=4096)
    out, inside = [], False
    for token, m in zip(tokenizer.convert_ids_to_tokens(ids), mask, strict=True):
        if m != inside:
            out.append("⟦" if m else "⟧")
            inside = bool(m)
        out.append(token.replace("\n", "\\n"))
    return " ".join(out + (["⟧"] if inside else []))


SYSTEM = {"role": "system", "content": "You are terse."}
Q1 = {"role": "user", "content": "What is 2+2?"}
Q2 = {"role": "user", "content": "And 3+3?"}
A1 = {"role": "assistant", "reasoning_content": "Add them.", "content": "4"}
A2 = {"role": "assistant", "content": "<think>\nAdd again.\n</think>\n\n6"}
TWO_TURNS = [SYSTEM, Q1, A1, Q2, A2]

WEATHER = {"role": "user", "content": "Weather in Paris?"}
CALL = {"role": "assistant", "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
RESULT = {"role": "tool", "content": '{"temp": 21}'}
RESULT2 = {"role": "tool", "content": '{"rain": 0}'}
ANSWER = {"role": "assistant", "reasoning_content": "Got it.", "content": "21 C."}
TOOL_TURNS = [WEATHER, CALL, RESULT, RESULT2, ANSWER]

S, E, N, NN = "<|im_start|>", "<|im_end|>", "\\n", "\\n\\n"


def test_think_kept_only_after_the_last_query_and_stripped_from_history():
    tok = tokenizer_for("think_after_last_query", TWO_TURNS)
    # turn 1 comes before the last user query: the template drops its reasoning; its answer is supervised
    assert marked(tok, TWO_TURNS) == (
        f"{S} system {N} You are terse. {E} {N} {S} user {N} What is 2+2? {E} {N} "
        f"{S} assistant {N} ⟦ 4 {E} ⟧ {N} {S} user {N} And 3+3? {E} {N} "
        f"{S} assistant {N} ⟦ <think> {N} Add again. {N} </think> {NN} 6 {E} ⟧ {N}")


def test_think_block_in_the_generation_prompt_is_not_supervised():
    tok = tokenizer_for("think_in_prompt", TWO_TURNS)
    assert marked(tok, TWO_TURNS) == (
        f"{S} system {N} You are terse. {E} {N} {S} user {N} What is 2+2? {E} {N} "
        f"{S} assistant {N} ⟦ 4 {E} ⟧ {N} {S} user {N} And 3+3? {E} {N} "
        f"{S} assistant {N} <think> {N} ⟦ Add again. {N} </think> {NN} 6 {E} ⟧ {N}")


def test_tool_calls_and_tool_responses_folded_into_a_user_turn():
    tok = tokenizer_for("think_after_last_query", TOOL_TURNS)
    call = '<tool_call> \\n {"name": "get_weather", "arguments": {"city": "Paris"}} \\n </tool_call>'
    assert marked(tok, TOOL_TURNS) == (
        f"{S} user {N} Weather in Paris? {E} {N} {S} assistant {N} ⟦ {call} {E} ⟧ {N} "
        f"{S} user {N} <tool_response> {N} {{\"temp\": 21}} {N} </tool_response> "
        f"{N} <tool_response> {N} {{\"rain\": 0}} {N} </tool_response> {E} {N} "
        f"{S} assistant {N} ⟦ <think> {N} Got it. {N} </think> {NN} 21 C. {E} ⟧ {N}")


def test_empty_think_block_token_straddling_the_prompt_is_not_supervised():
    """Qwen3.5-style: the prompt ends "<think>\\n", the render has "<think>" "\\n\\n" "</think>"; the
    "\\n\\n" token is half prompt, half answer, so it stays out of the loss."""
    tok = tokenizer_for("think_in_prompt", TOOL_TURNS)
    call = "<tool_call> \\n <function=get_weather> \\n <parameter=city> \\n Paris \\n </parameter> \\n " \
           "</function> \\n </tool_call>"
    assert marked(tok, TOOL_TURNS) == (
        f"{S} user {N} Weather in Paris? {E} {N} {S} assistant {N} <think> {NN} ⟦ </think> {NN} {call} {E} ⟧ {N} "
        f"{S} user {N} <tool_response> {N} {{\"temp\": 21}} {N} </tool_response> "
        f"{N} <tool_response> {N} {{\"rain\": 0}} {N} </tool_response> {E} {N} "
        f"{S} assistant {N} <think> {N} ⟦ Got it. {N} </think> {NN} 21 C. {E} ⟧ {N}")


def test_empty_think_block_on_the_last_turn_is_generated_when_the_prompt_has_none():
    conv = [Q1, {"role": "assistant", "content": "Hello"}]
    tok = tokenizer_for("think_after_last_query", conv)
    assert marked(tok, conv) == (f"{S} user {N} What is 2+2? {E} {N} "
                                 f"{S} assistant {N} ⟦ <think> {NN} </think> {NN} Hello {E} ⟧ {N}")


@pytest.mark.parametrize("template", ["think_after_last_query", "think_in_prompt"])
def test_reasoning_field_and_think_inside_content_render_the_same(template):
    as_field = [Q1, A1, Q2, {"role": "assistant", "reasoning_content": "Add again.", "content": "6"}]
    as_content = [Q1, {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"}, Q2, A2]
    tok = tokenizer_for(template, as_field, as_content)
    assert tokenize_conversation(tok, as_field, 4096) == tokenize_conversation(tok, as_content, 4096)


def test_generation_markers_are_used():
    conv = [Q1, {"role": "assistant", "content": "4"}, Q2, {"role": "assistant", "content": "6"}]
    tok = tokenizer_for("generation_markers", conv)
    assert marked(tok, conv) == (f"{S} user {N} What is 2+2? {E} {N} {S} assistant {N} ⟦ 4 {E} ⟧ {N} "
                                 f"{S} user {N} And 3+3? {E} {N} {S} assistant {N} ⟦ 6 {E} ⟧ {N}")


def test_spans_are_character_exact():
    tok = tokenizer_for("think_in_prompt", TWO_TURNS)
    text, spans = assistant_char_spans(tok, TWO_TURNS)
    assert [text[s:e] for s, e in spans] == ["4<|im_end|>", "Add again.\n</think>\n\n6<|im_end|>"]


@pytest.mark.parametrize("template", ["no_generation_prompt", "no_end_marker"])
def test_template_without_a_way_to_locate_turns_is_named(template):
    tok = tokenizer_for("think_after_last_query", TWO_TURNS)
    tok.chat_template = TEMPLATES[template].read_text()
    tok.name_or_path = f"org/{template}"
    with pytest.raises(ChatTemplateError, match=rf"chat template of org/{template} \(chat template sha256 "):
        tokenize_conversation(tok, TWO_TURNS, 4096)


@pytest.mark.parametrize("conv, reason", [
    ([Q1], "no_assistant_turn"),
    ([Q1, {"role": "assistant", "content": ""}, Q2, A2], "empty_assistant_turn"),
    ([Q1, {"role": "assistant", "content": "  "}], "empty_assistant_turn"),
    ([Q1, SYSTEM, A2], "template_error"),   # this template wants the system message first
])
def test_unusable_conversations_say_why(conv, reason):
    tok = tokenizer_for("think_in_prompt", TWO_TURNS)
    with pytest.raises(Unusable) as info:
        tokenize_conversation(tok, conv, 4096)
    assert info.value.reason == reason


def test_empty_turn_inside_generation_markers():
    tok = tokenizer_for("generation_markers", TWO_TURNS)
    with pytest.raises(Unusable, match="assistant turn 2 renders empty") as info:
        tokenize_conversation(tok, [Q1, {"role": "assistant", "content": "4"}, Q2,
                                    {"role": "assistant", "content": " "}], 4096)
    assert info.value.reason == "empty_assistant_turn"
