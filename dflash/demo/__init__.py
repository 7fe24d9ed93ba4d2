"""The built-in demo of `dflash-train` with no --target/--data: everything on a CPU in a few minutes.

    corpus.py     the synthetic chat corpus (ten task templates with learnable structure)
    tokenizer.py  a byte-level BPE chat tokenizer with ChatML and a mask token, trained locally
    target.py     the tiny Qwen3.5-style hybrid target, pre-trained on the corpus and cached
    pipeline.py   the demo run: build the target, regenerate its data, train, print tau
"""
