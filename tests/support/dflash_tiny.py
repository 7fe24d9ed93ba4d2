"""Tiny random Qwen3.5 / Qwen3 targets for the dflash tests, built locally in a few hundred ms.

Each is saved as a real HF directory (config.json + safetensors + tokenizer files) so the tests load it
back through `Target.load` exactly like a downloaded model.
"""

from __future__ import annotations

from pathlib import Path

import torch

# Models this small spend their time synchronising threads, not computing: one thread is ~10x faster
# on a loaded 2-core machine (a 26 ms instead of 264 ms forward of the tiny hybrid).
torch.set_num_threads(1)

VOCAB = 96  # word tokens w0..w(VOCAB-5) plus 4 specials
SPECIALS = ["<pad>", "<eos>", "<unk>", "<|MASK|>"]


def build_tokenizer(with_mask: bool = True):
    """A word-level tokenizer: "w0 w1 ..." -> ids; specials <pad> <eos> <unk> (+ <|MASK|>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(VOCAB - len(SPECIALS))]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + words)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    extra = {"mask_token": "<|MASK|>"} if with_mask else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", **extra)


def qwen3_5_config(num_layers: int = 8):
    """A Qwen3.5 hybrid text config: layers 3 and 7 full attention, the rest GatedDeltaNet."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="silu",
        linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, tie_word_embeddings=False,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "mrope_section": [1, 1, 0], "mrope_interleaved": True},
        pad_token_id=0, eos_token_id=1,
    )


def qwen3_config(num_layers: int = 6):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
        pad_token_id=0, eos_token_id=1,
    )


def save_tiny_target(out_dir: Path, kind: str = "qwen3_5", *, num_layers: int | None = None,
                     with_mask: bool = True, seed: int = 0) -> Path:
    """Write a random tiny target of `kind` ("qwen3_5" or "qwen3") to `out_dir`; return it."""
    from transformers import AutoModelForCausalLM

    config = qwen3_5_config(num_layers or 8) if kind == "qwen3_5" else qwen3_config(num_layers or 6)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    # Larger-than-default weights give peaked, varied greedy continuations instead of near-ties.
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0, 1.0)
        model.get_output_embeddings().weight.normal_(0, 0.5)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    build_tokenizer(with_mask).save_pretrained(out_dir)
    return out_dir
