"""Is a greedy speculative output lossless? Equal to plain greedy decoding token for token, or first different
only where the target itself could not tell the two tokens apart within its dtype's rounding (a near-tie).

At temperature 0 speculative decoding emits only the target's own argmax tokens, so in exact arithmetic its
output equals greedy decoding. In floating point it need not: the verify pass scores a whole block in one
forward, greedy decoding one token per forward; kernels of different shapes sum in different orders and
round differently (bf16 on a GPU most of all), and where the target's two best logits lie within that
rounding the argmax can flip between the two passes. From that position on the two outputs continue from
different prefixes, each of them greedy. A decoding error (a wrong accept rule, a bad cache rollback) instead
emits a token the target ranks clearly below its top one.

So the first position where the outputs differ is judged on the logits greedy decoding took its argmax of
there (`judge_divergence`), against a tolerance of NEAR_TIE_ULPS units in the last place of the top logit
in the dtype the target computes in (`near_tie_tolerance`):

    dtype      eps = finfo.eps   tolerance at a top logit of 20 (ulp 16 * eps)   at |top| <= 1
    bfloat16   2^-7              4 * 0.125    = 0.5                               4 * 2^-7  = 0.031
    float32    2^-23             4 * 1.9e-6   = 7.6e-6                            4 * 2^-23 = 4.8e-7

bf16 logits lie on a grid of 2^-7 relative spacing, so a flip between two passes usually shows as a margin of
0, 1 or 2 grid steps; 4 leaves room for the rounding of the hidden state before the head, and no more: a token
5 steps below the top is a failure. float32 keeps the CPU tests strict (4.8e-7 is far below any margin a
decoding error makes). The margin is the greedy token's logit minus the speculative token's: the top-2
margin when the speculative token is the runner-up, larger (stricter) when it ranks lower.
"""

from __future__ import annotations

import math

import torch

NEAR_TIE_ULPS = 4  # units in the last place of the top logit, in the target's dtype, that count as a tie


def near_tie_tolerance(top_logit: float, dtype: torch.dtype) -> float:
    """NEAR_TIE_ULPS units in the last place of `top_logit` in `dtype` (of 1.0 when |top_logit| < 1):
    NEAR_TIE_ULPS * finfo(dtype).eps * 2^floor(log2 max(|top_logit|, 1))."""
    return NEAR_TIE_ULPS * torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(max(abs(top_logit), 1.0)))


def judge_divergence(logits: torch.Tensor, greedy_token: int, spec_token: int | None,
                     dtype: torch.dtype | None = None) -> dict:
    """The near-tie rule, at the first position where speculative and greedy decoding differ.

    logits [V]: the target's logits there in greedy decoding's own forward (greedy_token is their argmax);
    spec_token: what speculative decoding emitted there (None: its output had ended). dtype: the one the
    target computes in (default: the logits'). Returns {"margin", "tolerance", "near_tie"}:

        margin    = logits[greedy_token] - logits[spec_token]                (>= 0)
        tolerance = near_tie_tolerance(max(logits), dtype)
        near_tie  = margin <= tolerance: rounding between the two passes, not a decoding error;
                    margin > tolerance, or no spec_token: the output is not lossless.
    """
    if spec_token is None:
        return {"margin": None, "tolerance": None, "near_tie": False}
    logits = logits.detach().float()
    top, greedy, spec = (float(v) for v in torch.stack([logits.max(), logits[greedy_token], logits[spec_token]]))
    margin, tolerance = greedy - spec, near_tie_tolerance(top, dtype or logits.dtype)
    return {"margin": margin, "tolerance": tolerance, "near_tie": margin <= tolerance}


class DivergenceWatch:
    """Watches plain greedy decoding (target_generate's on_step) against the speculative output `spec_tokens`
    and judges the first difference on the logits greedy decoding picked from (only there: one sync).

    finish(greedy tokens) -> None when the outputs are equal, else {"position" (in the generated tokens),
    "greedy_token", "spec_token" (None where that output had ended), "margin", "tolerance", "near_tie"}.
    """

    def __init__(self, spec_tokens: list[int], dtype: torch.dtype | None = None):
        self.spec, self.dtype, self.found = list(spec_tokens), dtype, None

    def __call__(self, position: int, token: int, logits: torch.Tensor) -> None:
        if self.found is None and (position >= len(self.spec) or token != self.spec[position]):
            spec_token = self.spec[position] if position < len(self.spec) else None
            self.found = {"position": position, "greedy_token": token, "spec_token": spec_token,
                          **judge_divergence(logits, token, spec_token, self.dtype)}

    def finish(self, greedy_tokens: list[int]) -> dict | None:
        if self.found is None and list(greedy_tokens) != self.spec:
            # Every greedy token matched and greedy decoding ended first: no logits to judge, not a tie.
            n = len(greedy_tokens)
            self.found = {"position": n, "greedy_token": None, "spec_token": self.spec[n],
                          "margin": None, "tolerance": None, "near_tie": False}
        return self.found


def describe(name: str, divergence: dict) -> str:
    """One line for the text table: where `name`'s output for a prompt first differed, and the verdict."""
    d = divergence
    where = (f"{name}: prompt {d['prompt']}, new token {d['position']}: greedy {d['greedy_token']}, "
             f"speculative {d['spec_token']}")
    if d["margin"] is None:
        return f"{where}: one output ended before the other: NOT lossless"
    verdict = "<=" if d["near_tie"] else ">"
    return (f"{where}, logit margin {d['margin']:.3g} {verdict} tolerance {d['tolerance']:.3g}: "
            f"{'near-tie' if d['near_tie'] else 'NOT lossless'}")
