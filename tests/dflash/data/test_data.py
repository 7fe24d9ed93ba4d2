"""dflash.chat, dflash.data, dflash.regenerate: JSONL parsing, assistant-only loss masks, drop counts,
bucketing, collate, regenerate."""

from __future__ import annotations

import json
import random

import pytest
import torch

from dflash.data.chat import load_chat_jsonl
from dflash.data.batches import ChatDataset, collate, make_batches, padding_fraction, tokenize_conversation
from dflash.demo.corpus import demo_conversations
from dflash.demo.tokenizer import CHAT_TEMPLATE, IM_END, build_chat_tokenizer
from dflash.errors import ChatTemplateError, DataError
from dflash.regenerate.local import generate_replies, regenerate

# ChatML without {% generation %} tags: the mask located in the full render must equal the tags' one.
PLAIN_CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CONVERSATION = [
    {"role": "system", "content": "you are brief"},
    {"role": "user", "content": "count from 3 to 7"},
    {"role": "assistant", "content": "3, 4, 5, 6, 7."},
    {"role": "user", "content": "tell me about the fox"},
    {"role": "assistant", "content": "the fox lives in the forest."},
]


@pytest.fixture(scope="module")
def tokenizer():
    texts = ["\n".join(m["content"] for m in c) for c in demo_conversations(400, seed=5)]
    return build_chat_tokenizer(texts, vocab_size=400)


def _write(tmp_path, lines):
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


# ---- JSONL ------------------------------------------------------------------------------------------
GOOD = json.dumps({"messages": CONVERSATION[1:3]})


def test_stop_names_file_and_line(tmp_path):
    path = _write(tmp_path, [GOOD, "", GOOD, "{not json", GOOD])
    with pytest.raises(DataError, match=rf"{path}:4: .*on_error='skip'"):
        load_chat_jsonl(path, on_error="stop")


def test_stop_names_line_of_bad_conversation(tmp_path):
    path = _write(tmp_path, [GOOD, json.dumps({"messages": [{"role": "developer", "content": "x"}]})])
    with pytest.raises(DataError, match=r":2: message 1 has role 'developer'"):
        load_chat_jsonl(path, on_error="stop")


def test_skip_counts_each_problem(tmp_path):
    lines = [GOOD, "{not json", json.dumps({"text": "no messages"}), "", json.dumps([{"role": "user"}]),
             json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}),
             json.dumps({"messages": [{"role": "user", "content": "q"},
                                      {"role": "assistant", "content": [{"type": "text", "text": "a"}]}]}),
             json.dumps({"messages": [{"role": "assistant", "content": "an answer to nothing"}]})]
    convs, report = load_chat_jsonl(_write(tmp_path, lines), on_error="skip")
    assert report.n_read == 7 and report.n_kept == 3  # the blank line is not a record
    assert report.skipped == {"bad_json": 1, "bad_conversation": 2, "roles_out_of_order": 1}
    assert any(":5: message 1: content must be a string" in e for e in report.examples)
    assert any(":8: roles out of order: message 1 is 'assistant'" in e for e in report.examples)
    assert convs[1] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert convs[2] == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]


def test_non_utf8_line_is_counted(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_bytes(GOOD.encode() + b"\n" + b'{"messages": "\xff\xfe"}\n')
    convs, report = load_chat_jsonl(path)
    assert len(convs) == 1 and report.skipped == {"not_utf8": 1}
    assert str(report) == f"{path}: read 2, kept 1, skipped 1 (1 not_utf8)"


def test_missing_file_is_named(tmp_path):
    with pytest.raises(DataError, match="nope.jsonl: no such file"):
        load_chat_jsonl(tmp_path / "nope.jsonl")


# ---- tokenisation -----------------------------------------------------------------------------------
def test_mask_covers_exactly_the_answers(tokenizer):
    ids, mask = tokenize_conversation(tokenizer, CONVERSATION, max_length=4096)
    assert len(ids) == len(mask) and set(mask) == {0, 1}
    supervised = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert supervised == f"3, 4, 5, 6, 7.{IM_END}the fox lives in the forest.{IM_END}"
    # the full text round-trips, so nothing was lost around the spans
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(CONVERSATION, tokenize=False)


def test_mask_matches_generation_tags(tokenizer):
    """Walking the full render and the template's {% generation %} tags are independent; they must agree."""
    for messages in [CONVERSATION] + demo_conversations(20, seed=3):
        ids, mask = tokenize_conversation(tokenizer, messages, max_length=4096)
        ref = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        assert ids == list(ref["input_ids"])
        assert mask == list(ref["assistant_masks"])


def test_mask_without_generation_tags(tokenizer):
    ids, mask = tokenize_conversation(tokenizer, CONVERSATION, max_length=4096)
    ids2, mask2 = tokenize_conversation(_with_template(tokenizer, PLAIN_CHATML), CONVERSATION, max_length=4096)
    assert (ids2, mask2) == (ids, mask)


def _with_template(tokenizer, template):
    tok = type(tokenizer)(tokenizer_object=tokenizer.backend_tokenizer)
    tok.chat_template = template
    return tok


def test_truncation(tokenizer):
    ids, mask = tokenize_conversation(tokenizer, CONVERSATION, max_length=12)
    assert len(ids) == len(mask) == 12


def test_template_without_turn_ends_is_refused(tokenizer):
    # no end-of-turn marker: where an answer stops cannot be located (nor its stop token supervised)
    template = ("{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m['role'] + ': ' + m['content'] }}"
                "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(ChatTemplateError, match="writes no end-of-turn marker"):
        tokenize_conversation(_with_template(tokenizer, template), CONVERSATION, max_length=100)


def test_tool_calls_reasoning_and_tool_messages_are_read(tmp_path):
    record = {"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "reasoning": "look it up",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "21 C", "tool_call_id": "c1", "name": None},
        {"role": "assistant", "content": "21 C."}]}
    convs, report = load_chat_jsonl(_write(tmp_path, [json.dumps(record)]), on_error="stop")
    assert convs[0][1] == {"role": "assistant", "content": "", "reasoning_content": "look it up", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert convs[0][2] == {"role": "tool", "content": "21 C", "tool_call_id": "c1"}


def test_dataset_drops_short_samples(tokenizer):
    short = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    long_ = [{"role": "user", "content": "count"}, {"role": "assistant", "content": ", ".join(map(str, range(40)))}]
    ds = ChatDataset([short, long_, short, long_, long_], tokenizer, max_length=512, block_size=8)
    assert len(ds) == 3 and ds.report.skipped == {"too_few_supervised_tokens": 2}
    assert ds.report.n_read == 5 and ds.report.n_kept == 3
    item = ds[0]
    assert item["input_ids"].dtype == torch.long and item["input_ids"].shape == item["loss_mask"].shape
    assert int(item["loss_mask"].sum()) >= 16
    # truncation can push a sample under the threshold: the answer starts after ~10 prompt tokens
    assert len(ChatDataset([long_], tokenizer, max_length=40, block_size=8)) == 1
    with pytest.raises(DataError, match="no usable samples.*too_few_supervised_tokens"):
        ChatDataset([long_], tokenizer, max_length=20, block_size=8)


# ---- batching ---------------------------------------------------------------------------------------
def _lengths(n=3000, seed=0):
    rng = random.Random(seed)
    return [int(rng.lognormvariate(5.5, 0.7)) + 20 for _ in range(n)]


def test_batches_deterministic_and_complete():
    lengths = _lengths()
    a = make_batches(lengths, max_tokens=8192, batch_size=8, seed=1, epoch=0)
    assert a == make_batches(lengths, max_tokens=8192, batch_size=8, seed=1, epoch=0)
    assert a != make_batches(lengths, max_tokens=8192, batch_size=8, seed=1, epoch=1)
    assert a != make_batches(lengths, max_tokens=8192, batch_size=8, seed=2, epoch=0)
    assert sorted(i for b in a for i in b) == list(range(len(lengths)))
    assert all(len(b) <= 8 and len(b) * max(lengths[i] for i in b) <= 8192 for b in a)


def test_bucketing_wastes_little_padding():
    lengths = _lengths()
    bucketed = make_batches(lengths, max_tokens=None, batch_size=16, seed=0, epoch=0)
    order = list(range(len(lengths)))
    random.Random(0).shuffle(order)
    unbucketed = [order[i:i + 16] for i in range(0, len(order), 16)]
    assert padding_fraction(lengths, bucketed) < 0.05
    assert padding_fraction(lengths, unbucketed) > 0.4


def test_batches_refuse_too_small_token_cap():
    with pytest.raises(ValueError, match="smaller than the longest sample"):
        make_batches([10, 500], max_tokens=100, batch_size=4, seed=0, epoch=0)


def test_collate_pads_right():
    items = [{"input_ids": torch.tensor([5, 6, 7]), "loss_mask": torch.tensor([0, 1, 1])},
             {"input_ids": torch.tensor([8]), "loss_mask": torch.tensor([1])}]
    batch = collate(items, pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


# ---- regenerate (a tiny random hybrid target: the mechanics, not the answers' quality) --------------
@pytest.fixture(scope="module")
def tiny_target(tokenizer):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from dflash.model.target import Target

    config = Qwen3_5TextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_num_key_heads=2,
        linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    return Target(Qwen3_5ForCausalLM(config), tokenizer, layer_ids=[1, 2])


def test_regenerate_replaces_and_appends(tiny_target):
    convs = [CONVERSATION, [{"role": "user", "content": "letters from a to f"}]]
    out = regenerate(tiny_target, convs, max_new_tokens=6, progress=False)
    assert [m["role"] for m in out[0]] == [m["role"] for m in CONVERSATION]
    assert [m["role"] for m in out[1]] == ["user", "assistant"]
    assert out[0][2]["content"] != CONVERSATION[2]["content"] and convs[1] == convs[1][:1]  # input untouched
    assert out[0][1] == CONVERSATION[1] and out[0][3] == CONVERSATION[3]
    assert out == regenerate(tiny_target, convs, max_new_tokens=6, progress=False)  # greedy: deterministic


def test_batched_greedy_equals_one_by_one(tiny_target):
    """Left padding must not change greedy answers: batched replies equal unbatched ones."""
    histories = [c[:1] for c in demo_conversations(4, seed=4, turns=(1, 1))]
    model, tok = tiny_target.model, tiny_target.tokenizer
    batched, _ = generate_replies(model, tok, histories, 6, batch_size=4)
    single = [generate_replies(model, tok, [h], 6, batch_size=1)[0][0] for h in histories]
    assert batched == single


def test_sampling_is_seeded(tiny_target):
    histories = [[{"role": "user", "content": "count from 1 to 9"}]] * 3
    model, tok = tiny_target.model, tiny_target.tokenizer
    a, _ = generate_replies(model, tok, histories, 8, temperature=1.0, seed=7)
    assert a == generate_replies(model, tok, histories, 8, temperature=1.0, seed=7)[0]
    assert a != generate_replies(model, tok, histories, 8, temperature=1.0, seed=8)[0]


def test_template_is_chatml(tokenizer):
    assert tokenizer.chat_template == CHAT_TEMPLATE
    text = tokenizer.apply_chat_template(CONVERSATION[1:2], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\ncount from 3 to 7<|im_end|>\n<|im_start|>assistant\n"
