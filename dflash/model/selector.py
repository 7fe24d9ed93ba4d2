"""DFlash2's candidate selector: a low-rank pairwise score over adjacent slots' top-K candidates.

For the hidden state h_t of block slot t (t = 1..bs-1) the drafter's unary logits U_t (the target's LM
head, times `output_multiplier`, soft-capped at `final_logit_softcapping`) give K candidates b. Each is
scored after a predecessor token a (the anchor for slot 1, the token chosen at slot t-1 after that):

    S_t(a, b) = U_t(b) + < P[a] * W h_t , Q[b] >          P, Q: [V, r] codebooks, W: [r, H]

and decoding walks the slots left to right, taking at each the candidate of highest S_t given the
token just taken (`greedy_walk`): at temperature 0 the proposal is this path. Tensor names are the
engines': candidate_selector.{predecessor_codebook, successor_codebook, hidden_projection.weight}.

Initialisation (as NeMo Automodel 0.7.0 initialises its selector): P ~ N(0, 0.02), Q = 0, so a new
selector scores exactly the unary logits, and the greedy path starts as DFlash's argmax.
"""

from __future__ import annotations

import torch
from torch import nn


def unary_logits(logits: torch.Tensor, output_multiplier: float, softcap: float | None) -> torch.Tensor:
    """The drafter's logits as the engines score them: logits * multiplier, then softcap * tanh(x / softcap)."""
    if output_multiplier != 1.0:
        logits = logits * output_multiplier
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


class CandidateSelector(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.reset_codebooks()

    def reset_codebooks(self) -> None:
        with torch.no_grad():
            self.predecessor_codebook.normal_(0.0, 0.02)
            self.successor_codebook.zero_()

    def scores(self, hidden: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor,
               predecessors: torch.Tensor) -> torch.Tensor:
        """S(a, b) for each position: hidden [..., H], unary and candidates [..., K], predecessors [...]
        (the token before each position) -> [..., K] float32."""
        gate = self.predecessor_codebook[predecessors] * self.hidden_projection(hidden)       # [..., r]
        pair = torch.einsum("...r,...kr->...k", gate.float(), self.successor_codebook[candidates].float())
        return unary.float() + pair

    def greedy_walk(self, hidden: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor,
                    anchor_ids: torch.Tensor) -> torch.Tensor:
        """The temperature-0 path: hidden [B,n,H], unary/candidates [B,n,K], anchor_ids [B] -> tokens [B,n]."""
        previous, path = anchor_ids, []
        for t in range(hidden.shape[1]):
            s = self.scores(hidden[:, t], unary[:, t], candidates[:, t], previous)          # [B,K]
            previous = candidates[:, t].gather(-1, s.argmax(-1, keepdim=True)).squeeze(-1)
            path.append(previous)
        return torch.stack(path, dim=1)
