"""Regeneration: replace a chat dataset's answers with the target's own (DFlash trains best on them).

    chat.jsonl --load_chat_jsonl--> conversations --regenerate(target)--> the target's own answers
               --write_jsonl--> out.jsonl            (`dflash regenerate --target DIR`: regenerate_jsonl)

This is the in-process path (HF `generate` in this process, written at the end), for the demo and small
runs. Large sets go through an inference server: dflash/regenerate/server.py (`--endpoint URL`), which
answers the same turns (`reply_slots`) in the same order. torch is imported inside the functions that
use it, so the server client can import `reply_slots` without it.
"""

from __future__ import annotations

import logging

from dflash.data.chat import Conversation, load_chat_jsonl, render, tools_of, write_jsonl

log = logging.getLogger(__name__)


def generate_replies(model, tokenizer, histories: list[list[dict]], max_new_tokens: int, *,
                     temperature: float = 0.0, seed: int = 0, batch_size: int = 32,
                     progress: bool = False) -> tuple[list[str], int]:
    """The model's next assistant message for each history; returns (replies, n_cut_at_max_new_tokens).

    Prompts are batched by length (left-padded: the attention mask keeps full-attention layers off the
    padding, and GatedDeltaNet layers zero padded inputs, so a padded row decodes like an unpadded one).
    Greedy when temperature == 0; otherwise sampled, reproducibly for a given seed.
    """
    import torch
    from tqdm.auto import tqdm

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    pad = eos if pad is None else pad
    device = next(model.parameters()).device
    prompts = [tokenizer(render(tokenizer, h, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
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
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
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


def reply_slots(messages: list[dict]) -> list[int]:
    """Indices the target answers: each assistant message, plus one past the end after a final user (or
    tool) turn. An assistant turn that calls tools is kept as the dataset has it: its call is answered by
    the following `tool` message, which no regenerated call would match."""
    slots = [i for i, m in enumerate(messages) if m["role"] == "assistant" and not m.get("tool_calls")]
    if messages and messages[-1]["role"] in ("user", "tool"):
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
    result = [Conversation([dict(m) for m in messages], tools_of(messages)) for messages in conversations]
    slots = [reply_slots(messages) for messages in result]
    total_cut = total = 0
    for turn in range(max((len(s) for s in slots), default=0)):
        todo = [(c, s[turn]) for c, s in enumerate(slots) if turn < len(s)]
        histories = [Conversation(result[c][:slot], result[c].tools) for c, slot in todo]  # with the tools
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


def regenerate_jsonl(target_dir, data, out, *, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
                     device: str = "auto", on_bad_line: str = "skip") -> str:
    """`dflash regenerate`: load the target, regenerate every conversation of `data`, write `out`;
    returns a one-line summary."""
    from dflash import distributed
    from dflash.errors import ConfigError
    from dflash.model.target import Target

    if temperature < 0 or max_new_tokens < 1:
        raise ConfigError("--temperature must be >= 0 and --max-new-tokens >= 1.")
    target = Target.load(target_dir, device=distributed.pick_device(device, 0))
    conversations, report = load_chat_jsonl(data, on_error=on_bad_line)
    result = regenerate(target, conversations, max_new_tokens, temperature=temperature, seed=seed)
    write_jsonl(out, result)
    return f"wrote {len(result)} conversations to {out} ({report})"
