"""A tiny chat-capable target and chat data for the training, checkpoint, CLI and DDP tests.

The target is a random 4-layer Qwen3.5 hybrid (3 GatedDeltaNet + 1 full-attention layer) with the
project's byte-level chat tokenizer (ChatML template, <|mask|>), saved as a real HF directory: enough
for every mechanical test of the trainer in well under a second. The learning test uses the real,
pre-trained demo target instead.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def save_chat_target(out_dir: Path, *, hidden_size: int = 32, num_layers: int = 4, seed: int = 0) -> Path:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from dflash.demo.corpus import demo_conversations
    from dflash.demo.tokenizer import build_chat_tokenizer

    texts = [m["content"] for c in demo_conversations(200, seed=123) for m in c]
    tokenizer = build_chat_tokenizer(texts, vocab_size=320)
    config = Qwen3_5TextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=48, num_hidden_layers=num_layers,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="silu",
        linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [1, 1, 0], "mrope_interleaved": True},
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(config)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def write_chat_jsonl(path: Path, n: int = 24, seed: int = 0) -> Path:
    """`n` built-in demo conversations as a chat JSONL ({"messages": [...]} per line)."""
    from dflash.demo.corpus import demo_conversations

    path = Path(path)
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in demo_conversations(n, seed=seed)))
    return path


def train_args(target: Path, data: Path, out: Path, **extra) -> list[str]:
    """dflash-train flags for a few fast steps on the tiny target (extra: flag name -> value)."""
    opts = dict(block_size=4, drafter_layers=1, max_length=96, max_tokens=512, batch_size=4, max_anchors=8,
                max_steps=4, epochs=0, log_every=1, save_every=0, seed=0, device="cpu", cpu_threads=1)
    opts.update(extra)
    argv = ["--target", str(target), "--data", str(data), "--out", str(out), "--no-progress"]
    for key, value in opts.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv


def read_metrics(out: Path) -> list[dict]:
    from dflash.train.records.rundir import RunDir

    return [json.loads(line) for line in RunDir(out).metrics.read_text().splitlines() if line]


def drop_run_log_handlers() -> None:
    """Remove the handlers a dflash-train run gave the "dflash" logger (bound to that test's stderr and
    train.log), so that a later command in the same test process does not log into them."""
    import logging

    logger = logging.getLogger("dflash")
    for handler in [h for h in logger.handlers if getattr(h, "_dflash", False)]:
        logger.removeHandler(handler)
        handler.close()


def assert_same_run(a: Path, b: Path, tolerance: float = 1e-6, weights_tolerance: float | None = None) -> None:
    """Two runs trained the same: per-step losses and gradient norms to `tolerance` (relative), the same tokens
    and anchors, and the same exported drafter (file names, config.json, fp32 weights to `weights_tolerance`,
    absolute and relative; `tolerance` when not given)."""
    import pytest
    import torch
    from safetensors.torch import load_file

    from dflash.train.records.rundir import RunDir

    one, other = read_metrics(a), read_metrics(b)
    assert [m["step"] for m in other] == [m["step"] for m in one] and one
    for x, y in zip(one, other):
        assert y["loss"] == pytest.approx(x["loss"], rel=tolerance)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=tolerance)
        assert (y["tokens"], y["anchors"]) == (x["tokens"], x["anchors"])
    da, db = RunDir(a).drafter, RunDir(b).drafter
    assert sorted(p.name for p in da.iterdir()) == sorted(p.name for p in db.iterdir())
    assert (da / "config.json").read_text() == (db / "config.json").read_text()
    wa, wb = load_file(str(da / "model.safetensors")), load_file(str(db / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for name in wa:
        assert wb[name].dtype == wa[name].dtype == torch.float32
        weights = tolerance if weights_tolerance is None else weights_tolerance
        torch.testing.assert_close(wb[name], wa[name], rtol=weights, atol=weights)

