"""A small chat tokenizer built locally: byte-level BPE + ChatML template + a mask token.

The demo target needs a tokenizer that behaves like a real Qwen one (special tokens, a chat template,
a mask token for DFlash blocks) without downloading anything. Byte-level BPE can encode any text
(so user JSONL never hits an unknown token), and a vocabulary of a few hundred entries trained on the
demo corpus turns most corpus words into single tokens, which keeps the demo target tiny.

Rendered conversation (ChatML, as Qwen does it; the assistant part between the generation tags is what
`return_assistant_tokens_mask` marks, and what `dflash.data.spans.tokenize_conversation` supervises):

    <|im_start|>user\\n{content}<|im_end|>\\n
    <|im_start|>assistant\\n{% generation %}{content}<|im_end|>{% endgeneration %}\\n
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # also the end-of-sequence token: generation stops after an assistant turn
MASK_TOKEN = "<|mask|>"  # fills positions 1..bs-1 of a DFlash block; must exist in the target vocab
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END, MASK_TOKEN]

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_chat_tokenizer(texts: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `texts` and wrap it as a chat tokenizer.

    The result has ids 0..3 for SPECIAL_TOKENS (pad, im_start, im_end, mask), the 256 byte symbols,
    then merges up to `vocab_size` entries in total. Training is single-pass and deterministic for
    the same texts (the BPE trainer breaks count ties by pair order).
    """
    min_size = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size <= min_size:
        raise ValueError(
            f"vocab_size={vocab_size} leaves no room for merges: the {len(SPECIAL_TOKENS)} special tokens "
            f"and 256 byte symbols already take {min_size}; use vocab_size >= {min_size + 64}"
        )
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    return wrap_chat_tokenizer(bpe)


def wrap_chat_tokenizer(bpe: Tokenizer) -> PreTrainedTokenizerFast:
    """Wrap a `tokenizers.Tokenizer` holding SPECIAL_TOKENS as a transformers chat tokenizer."""
    missing = [t for t in SPECIAL_TOKENS if bpe.token_to_id(t) is None]
    if missing:
        raise ValueError(f"tokenizer lacks special tokens {missing}; train it with special_tokens={SPECIAL_TOKENS}")
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        mask_token=MASK_TOKEN,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
