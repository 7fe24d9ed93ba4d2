"""Training data for DFlash: chat JSONL -> token ids + assistant-only loss mask -> length-bucketed batches.

    chat.jsonl --load_chat_jsonl--> conversations --regenerate(target)--> the target's own answers
               --ChatDataset(tokenizer, max_length, block_size)--> items {input_ids [T], loss_mask [T]}
               --make_batches(lengths, max_tokens, batch_size, seed, epoch) + collate--> padded batches

Training on the target's own responses (not the dataset's) is what DFlash wants: the drafter must
predict what *this* target says next. Samples with fewer than 2 x block_size supervised tokens teach
too few blocks and are dropped (SpecForge does the same), and every drop is counted in a DataReport.
"""

from __future__ import annotations

import json
import logging
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
# ShareGPT spells roles differently; these are the spellings seen in the wild.
_ROLE_ALIASES = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant"}
_MESSAGE_KEYS = ("messages", "conversations", "conversation")


class DataError(ValueError):
    """Bad training data; the message names the file, line or sample and says how to fix it."""


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


# --------------------------------------------------------------------------------------------------
# Tokenisation with an assistant-only loss mask
# --------------------------------------------------------------------------------------------------
def _render(tokenizer, messages, add_generation_prompt=False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_char_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the [start, end) character span of each assistant answer.

    A span runs from the end of the generation prompt (e.g. "<|im_start|>assistant\\n") to the end of
    the answer including its end token ("<|im_end|>"), without trailing whitespace: what the model
    itself must produce. It is found by rendering prefixes, which works for any template whose
    rendering of messages[:i] is a prefix of the whole (ChatML and Qwen's templates are).
    """
    full = _render(tokenizer, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        through = _render(tokenizer, messages[: i + 1])
        if not (full.startswith(through) and through.startswith(before)):
            raise DataError(
                f"the chat template renders assistant message {i + 1} differently depending on what follows "
                "(a prefix render is not a prefix of the full render), so answer tokens cannot be located; "
                "use a template where earlier turns render the same way, e.g. plain ChatML"
            )
        spans.append((len(before), len(through.rstrip())))
    return full, spans


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int) -> tuple[list[int], list[int]]:
    """Chat-template token ids and a loss mask that is 1 exactly on assistant answer tokens.

    Returns (input_ids, loss_mask), both truncated to `max_length`. A token counts as assistant when
    its character range overlaps an answer span (see `assistant_char_spans`); that needs a fast
    tokenizer (offset mappings).
    """
    if max_length < 2:
        raise ValueError(f"max_length={max_length} is too short; use at least a few hundred tokens")
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(f"{type(tokenizer).__name__} is not a fast tokenizer; load it with use_fast=True "
                        "(offset mappings are needed to find the assistant tokens)")
    text, spans = assistant_char_spans(tokenizer, messages)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = list(encoded["input_ids"][:max_length])
    loss_mask = [int(any(s < end and e > start for start, end in spans))
                 for s, e in encoded["offset_mapping"][:max_length]]
    return input_ids, loss_mask


class ChatDataset(torch.utils.data.Dataset):
    """Tokenised conversations; items are {"input_ids": LongTensor[T], "loss_mask": LongTensor[T]}.

    Samples with fewer than `min_supervised` (default 2 * block_size) assistant tokens after
    truncation are dropped and counted in `.report` (reason "too_few_supervised_tokens"); so are
    conversations the template cannot render ("template_error").
    """

    def __init__(self, conversations, tokenizer, *, max_length: int, block_size: int = 16,
                 min_supervised: int | None = None, source: str = "chat dataset"):
        self.min_supervised = 2 * block_size if min_supervised is None else min_supervised
        self.report = DataReport(source=source)
        self.input_ids: list[list[int]] = []
        self.loss_masks: list[list[int]] = []
        for n, messages in enumerate(conversations, start=1):
            self.report.n_read += 1
            try:
                ids, mask = tokenize_conversation(tokenizer, messages, max_length)
            except Exception as exc:  # jinja raises its own types for templates that reject a conversation
                self.report.skip("template_error", f"conversation {n}: {exc}")
                continue
            if sum(mask) < self.min_supervised:
                self.report.skip("too_few_supervised_tokens",
                                 f"conversation {n}: {sum(mask)} supervised tokens < {self.min_supervised}")
                continue
            self.input_ids.append(ids)
            self.loss_masks.append(mask)
            self.report.n_kept += 1
        if not self.input_ids:
            raise DataError(
                f"no usable samples: {self.report.summary()}; every sample needs >= {self.min_supervised} "
                f"assistant tokens within max_length={max_length}: use longer answers, raise max_length "
                "or lower block_size"
            )
        log.info("%s", self.report.summary())

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.tensor(self.input_ids[i], dtype=torch.long),
                "loss_mask": torch.tensor(self.loss_masks[i], dtype=torch.long)}

    @property
    def lengths(self) -> list[int]:
        return [len(ids) for ids in self.input_ids]


# --------------------------------------------------------------------------------------------------
# Batching
# --------------------------------------------------------------------------------------------------
def make_batches(lengths: list[int], max_tokens: int | None, batch_size: int, seed: int, epoch: int,
                 pool_batches: int = 64) -> list[list[int]]:
    """Length-bucketed batches of sample indices; the same (seed, epoch) always gives the same list.

    Indices are shuffled, cut into pools of `pool_batches * batch_size`, sorted by length inside each
    pool, and packed greedily into batches of at most `batch_size` samples and at most `max_tokens`
    padded tokens (batch size x longest sample; None = no token cap). The batch order is shuffled
    again, so neighbouring steps see different lengths. Sorting within pools (not globally) keeps
    padding low while every epoch still mixes samples differently.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not lengths:
        return []
    if max_tokens is not None and max_tokens < max(lengths):
        raise ValueError(f"max_tokens={max_tokens} is smaller than the longest sample ({max(lengths)} tokens); "
                         "raise max_tokens to at least that, or lower max_length")
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    pool = pool_batches * batch_size
    batches = []
    for start in range(0, len(order), pool):
        batch, longest = [], 0
        for i in sorted(order[start:start + pool], key=lengths.__getitem__):
            grown = max(longest, lengths[i])
            if batch and (len(batch) == batch_size or (max_tokens and grown * (len(batch) + 1) > max_tokens)):
                batches.append(batch)
                batch, grown = [], lengths[i]
            batch.append(i)
            longest = grown
        batches.append(batch)
    rng.shuffle(batches)
    log.debug("epoch %d: %d batches, %.1f%% padding", epoch, len(batches), 100 * padding_fraction(lengths, batches))
    return batches


def padding_fraction(lengths: list[int], batches: list[list[int]]) -> float:
    """Share of padded positions in `batches` (0 = no padding): 1 - real tokens / (B x T summed)."""
    real = sum(lengths[i] for batch in batches for i in batch)
    padded = sum(len(batch) * max(lengths[i] for i in batch) for batch in batches)
    return 1.0 - real / padded if padded else 0.0


def shard_batches(batches: list[list[int]], rank: int, world_size: int) -> list[list[int]]:
    """This rank's batches: every rank gets the same count (the tail is dropped) so DDP steps stay in step."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    if len(batches) < world_size:
        raise DataError(f"{len(batches)} batches cannot feed {world_size} ranks; use more data, a smaller "
                        "batch size or fewer processes")
    usable = len(batches) - len(batches) % world_size
    return batches[rank:usable:world_size]


def collate(items: list[dict[str, torch.Tensor]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad items to the longest: input_ids [B,T] (pad_id), loss_mask [B,T] (0), attention_mask [B,T]."""
    if not items:
        raise ValueError("cannot collate an empty batch")
    longest = max(len(item["input_ids"]) for item in items)
    input_ids = torch.full((len(items), longest), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((len(items), longest), dtype=torch.long)
    attention_mask = torch.zeros((len(items), longest), dtype=torch.long)
    for row, item in enumerate(items):
        n = len(item["input_ids"])
        input_ids[row, :n] = item["input_ids"]
        loss_mask[row, :n] = item["loss_mask"]
        attention_mask[row, :n] = 1
    return {"input_ids": input_ids, "loss_mask": loss_mask, "attention_mask": attention_mask}


# --------------------------------------------------------------------------------------------------
# Regeneration: replace the dataset's answers with the target's own
# --------------------------------------------------------------------------------------------------
@torch.no_grad()
def generate_replies(model, tokenizer, histories: list[list[dict]], max_new_tokens: int, *,
                     temperature: float = 0.0, seed: int = 0, batch_size: int = 32,
                     progress: bool = False) -> tuple[list[str], int]:
    """The model's next assistant message for each history; returns (replies, n_cut_at_max_new_tokens).

    Prompts are batched by length (left-padded: the attention mask keeps full-attention layers off the
    padding, and GatedDeltaNet layers zero padded inputs, so a padded row decodes like an unpadded one).
    Greedy when temperature == 0; otherwise sampled, reproducibly for a given seed.
    """
    from tqdm.auto import tqdm

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    pad = eos if pad is None else pad
    device = next(model.parameters()).device
    prompts = [tokenizer(_render(tokenizer, h, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
               for h in histories]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    replies: list[str] = [""] * len(prompts)
    n_cut = 0
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    # top_k=0 turns off generate's default top-k 50: sample from the target's full distribution
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature else {"do_sample": False}
    for start in tqdm(range(0, len(order), batch_size), desc="regenerate", unit="batch", disable=not progress):
        rows = order[start:start + batch_size]
        width = max(len(prompts[i]) for i in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, i in enumerate(rows):
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed * 1_000_003 + start)
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad, **sampling)
        for r, i in enumerate(rows):
            new = out[r, width:].tolist()
            if eos in new:
                new = new[:new.index(eos)]
            else:
                n_cut += 1
            replies[i] = tokenizer.decode(new, skip_special_tokens=True)
    return replies, n_cut


def _reply_slots(messages: list[dict]) -> list[int]:
    """Indices the target answers: each assistant message, plus one past the end after a final user turn."""
    slots = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if messages and messages[-1]["role"] == "user":
        slots.append(len(messages))
    return slots


def regenerate(target, conversations: list[list[dict]], max_new_tokens: int, temperature: float = 0.0,
               seed: int = 0, *, batch_size: int = 32, progress: bool = True) -> list[list[dict]]:
    """Conversations whose assistant turns are replaced by `target`'s own responses.

    Turns are answered in order, so a later answer sees the target's earlier answers, never the
    dataset's. A conversation ending with a user prompt gets an answer appended. Greedy decoding when
    temperature == 0 (the default), else sampling, reproducible for a given seed. Answers that hit
    max_new_tokens are kept, cut there (counted in the log).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    result = [[dict(m) for m in messages] for messages in conversations]
    slots = [_reply_slots(messages) for messages in result]
    total_cut = total = 0
    for turn in range(max((len(s) for s in slots), default=0)):
        todo = [(c, s[turn]) for c, s in enumerate(slots) if turn < len(s)]
        histories = [result[c][:slot] for c, slot in todo]
        replies, n_cut = generate_replies(target.model, target.tokenizer, histories, max_new_tokens,
                                          temperature=temperature, seed=seed + turn, batch_size=batch_size,
                                          progress=progress)
        for (c, slot), reply in zip(todo, replies):
            answer = {"role": "assistant", "content": reply}
            if slot < len(result[c]):
                result[c][slot] = answer
            else:
                result[c].append(answer)
        total_cut, total = total_cut + n_cut, total + len(todo)
    log.info("regenerated %d answers in %d conversations; %d hit max_new_tokens=%d",
             total, len(result), total_cut, max_new_tokens)
    return result
