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
        (the token before each position) -> [..., K], float32 or wider."""
        gate = self.predecessor_codebook[predecessors] * self.hidden_projection(hidden)       # [..., r]
        dt = torch.promote_types(gate.dtype, torch.float32)  # float32 at least (float64 stays float64)
        pair = torch.einsum("...r,...kr->...k", gate.to(dt), self.successor_codebook[candidates].to(dt))
        return unary.to(dt) + pair

    def lattice(self, hidden: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor,
                anchor_ids: torch.Tensor) -> torch.Tensor:
        """Every slot's K x K scores at once, as the engines score them: hidden [B,n,H], unary/candidates
        [B,n,K], anchor_ids [B] -> [B,n,K,K] (float32 or wider), [b,t,p,c] = S_t(predecessor p, candidate c), the
        predecessors of slot 0 being the anchor (every row alike), of slot t the candidates of slot t-1."""
        K = candidates.shape[-1]
        preds = torch.cat([anchor_ids[:, None, None].expand(-1, 1, K), candidates[:, :-1]], dim=1)  # [B,n,K]
        gate = self.predecessor_codebook[preds] * self.hidden_projection(hidden).unsqueeze(2)     # [B,n,K,r]
        dt = torch.promote_types(gate.dtype, torch.float32)
        pair = torch.einsum("btpr,btcr->btpc", gate.to(dt), self.successor_codebook[candidates].to(dt))
        return unary.to(dt).unsqueeze(2) + pair

    def greedy_walk(self, hidden: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor,
                    anchor_ids: torch.Tensor) -> torch.Tensor:
        """The temperature-0 path: hidden [B,n,H], unary/candidates [B,n,K], anchor_ids [B] -> tokens [B,n]:
        slot 0 takes the best candidate after the anchor, slot t the best after slot t-1's pick."""
        lattice = self.lattice(hidden, unary, candidates, anchor_ids)                          # [B,n,K,K]
        index = torch.zeros(hidden.shape[0], dtype=torch.long, device=hidden.device)
        picks = []
        for t in range(hidden.shape[1]):
            row = lattice[:, t].gather(1, index[:, None, None].expand(-1, 1, lattice.shape[-1])).squeeze(1)
            index = row.argmax(-1)
            picks.append(index)
        return candidates.gather(-1, torch.stack(picks, dim=1).unsqueeze(-1)).squeeze(-1)

    def sampled_walk(self, hidden: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor,
                     anchor_ids: torch.Tensor, temperature: float, generator: torch.Generator | None,
                     vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The walk at temperature > 0, one sequence (B = 1): each slot samples its candidate from
        softmax(row / temperature) of the row after the previous pick (vLLM's Gumbel draw, SGLang's inverse
        CDF and the reference's multinomial all sample this distribution). Returns tokens [n] and q [n,V]
        float32: the realized rows' distributions over the vocabulary (zero off the candidates), the q that
        speculative sampling checks the draft against."""
        lattice = self.lattice(hidden, unary, candidates, anchor_ids)[0].float().cpu()         # [n,K,K]
        cands = candidates[0].cpu()
        index, tokens, q = 0, [], torch.zeros(lattice.shape[0], vocab_size)
        for t in range(lattice.shape[0]):
            probs = torch.softmax(lattice[t, index] / temperature, dim=-1)
            index = int(torch.multinomial(probs, 1, generator=generator))
            q[t].index_add_(0, cands[t], probs)
            tokens.append(int(cands[t, index]))
        return torch.tensor(tokens), q
