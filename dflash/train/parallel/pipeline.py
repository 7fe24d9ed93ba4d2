"""--layout pipeline: the frozen target's layers in stages on some ranks, the drafter trained on the others.

Who holds what (W ranks, S = --target-stages, D = W - S; dflash.train.parallel.layouts.pipeline_roles; the
drafter ranks come first, so rank 0 is the one that logs, as under every layout):
    ranks 0..D-1     drafter ranks: the target's embedding and LM head (frozen, no decoder layer), and the
                     drafter with its gradients and AdamW state sharded among themselves (FSDP2, as --layout
                     shard; D = 1 holds it whole). Rank 0 logs, writes metrics and checkpoints.
    ranks D..W-1     stage ranks: rank D+s holds the target's layers [start_s, stop_s) (contiguous, by layer
                     count; stage 0 also the embedding). No drafter, no optimizer, no data.

One micro-batch (each drafter rank j holds its share of the global micro-batch, as under the other layouts):
    drafter j -> every stage   header [B, T, S] (int64), then input_ids [B,T] and attention_mask [B,T] (int64);
                               packed rows (S > 0): then their segments, positions / seq_idx / starts [3,B,T]
                               and cu_seqlens [S] (int64), and the stages run them as Target.context does
    stage s                    stage 0 embeds the ids; stage s > 0 receives the hidden states [B,T,H]
                               (target dtype) from stage s-1; runs its layers, keeps its tapped layers'
                               outputs, sends the hidden states on to stage s+1 (all but the last stage)
    stage s -> drafter j       its tapped layers' outputs, concatenated [B,T,n_s*H], when it holds any;
                               then its stop status [1] (int64: 0, or the number of the signal it got)
    drafter j                  concatenates them in layer order: exactly Target.context's result; a stage's
                               signal becomes the drafter rank's own stop request, so SIGTERM or Ctrl-C to
                               any rank stops the whole run the same way (checkpoint, then exit 143 / 130)
The stages serve the drafter ranks in rank order, micro-batch after micro-batch; sends are
torch.distributed point-to-point (isend/irecv, completed before the next share), nothing else is
shared. When training ends (or stops) every drafter rank sends a header [0, 0, status] (its stop status:
0, or the exit code of the signal that stopped the run) and the stages return, a stopped run's with that
code (a stage rank of a run stopped by a drafter rank's SIGTERM exits 143 too, not 0).
"""

from __future__ import annotations

import logging
import signal

import torch
import torch.distributed as dist

from dflash.train.parallel.layouts import PipelineRoles

log = logging.getLogger("dflash.train")


class _Skip(torch.nn.Module):
    """Stands in for a decoder layer another rank holds: passes the hidden states through."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def keep_layers(target, keep: range, device: torch.device, embed: bool, head: bool) -> None:
    """Move the layers in `keep` (and the embedding / LM head when asked) to `device`; every other layer
    is replaced by a pass-through (its weights freed), an unneeded embedding or head stays on the CPU."""
    for i in range(target.num_layers):
        if i in keep:
            target._layers[i].to(device)
        else:
            target._layers[i] = _Skip()
    decoder = target._decoder
    for name, module in decoder.named_children():
        if name not in ("layers", "embed_tokens"):
            module.to(device)  # the final norm, the rotary embedding: tiny
    if embed:
        target._embed.to(device)
    if head:
        target._head.to(device)


class StageTarget:
    """Runs one stage's layers of a Target whose other layers are pass-throughs (keep_layers)."""

    def __init__(self, target, roles: PipelineRoles, stage: int, device: torch.device):
        self.target, self.roles, self.stage, self.device = target, roles, stage, device
        self.start, self.stop = roles.stages[stage]
        self.taps = [i for i in target.layer_ids if self.start <= i < self.stop]
        # the pass ends after this stage's last layer, whose output the next stage takes; the last stage
        # passes nothing on, so it ends after its last tapped layer (dflash.model.tapped_pass)
        last_stage = stage == len(roles.stages) - 1
        self.end = max(self.taps) if last_stage and self.taps else self.stop - 1

    @torch.no_grad()
    def run(self, ids: torch.Tensor, attn: torch.Tensor, hidden: torch.Tensor | None, segments=None):
        """(hidden after layer self.end [B,T,H], this stage's tapped outputs [B,T,n*H] or None); `segments`:
        packed rows, run through the decoder's packed-sequence arguments (no mask)."""
        from dflash.model.tapped_pass import tapped_pass
        from dflash.model.target import packed_decoder_kwargs

        inputs = {"input_ids": ids} if hidden is None else {"inputs_embeds": hidden}
        if segments is not None:
            inputs.update(packed_decoder_kwargs(segments), attention_mask=None)
        else:
            inputs["attention_mask"] = attn
        _, captured = tapped_pass(self.target._decoder, self.target._layers, self.taps, self.end,
                                  use_cache=False, **inputs)
        taps = torch.cat([captured[i] for i in self.taps], dim=-1).contiguous() if self.taps else None
        return captured[self.end].contiguous(), taps


def _header(B: int, T: int, S: int = 0) -> torch.Tensor:
    return torch.tensor([B, T, S], dtype=torch.long)


def _segments_wire(segments) -> tuple[torch.Tensor, torch.Tensor]:
    """Segments as two int64 tensors: positions / seq_idx / starts [3,B,T] and cu_seqlens [S]."""
    rows = torch.stack([segments.position_ids, segments.seq_idx.long(), segments.starts])
    return rows, segments.cu_seqlens.long()


def _segments_from_wire(rows: torch.Tensor, cu: torch.Tensor):
    from dflash.model.segments import Segments

    return Segments(position_ids=rows[0], seq_idx=rows[1].int(), starts=rows[2], cu_seqlens=cu.int(),
                    max_seqlen=int((cu[1:] - cu[:-1]).max()))


def _status(stop) -> torch.Tensor:
    """A stage's stop status: 0, or the number of the signal that set its StopFlag (SIGTERM's for a stop
    requested another way)."""
    code = signal.Signals.__members__.get(stop.reason, signal.SIGTERM).value if stop else 0
    return torch.tensor([code], dtype=torch.long)


def serve_stage(stage_target: StageTarget, rank_of_stage: list[int], drafter_ranks: list[int],
                device: torch.device, dtype: torch.dtype, stop) -> int:
    """Stage rank's loop: serve every drafter rank's share of each micro-batch until all send [0, 0]; with
    each share goes this rank's stop status (`stop`: its StopFlag, set by a signal). Returns the number of
    shares served."""
    s, target = stage_target.stage, stage_target.target
    H, last = target.hidden_size, stage_target.stage == len(rank_of_stage) - 1
    comm = device if dist.get_backend() == "nccl" else torch.device("cpu")  # where the wire tensors live
    served, done = 0, set()
    while len(done) < len(drafter_ranks):
        pending = []
        for j in drafter_ranks:
            if j in done:
                continue
            head = _header(0, 0).to(comm)
            dist.recv(head, src=j)
            B, T, S = (int(x) for x in head.tolist())
            if B == 0:  # [0, 0, status]: that drafter rank is done, stopped by a signal when status says so
                done.add(j)
                stop.adopt(S)
                continue
            ids = torch.empty(B, T, dtype=torch.long, device=comm)
            attn = torch.empty(B, T, dtype=torch.long, device=comm)
            dist.recv(ids, src=j)
            dist.recv(attn, src=j)
            segments = None
            if S:
                rows, cu = torch.empty(3, B, T, dtype=torch.long, device=comm), torch.empty(S, dtype=torch.long, device=comm)
                dist.recv(rows, src=j)
                dist.recv(cu, src=j)
                segments = _segments_from_wire(rows.to(device), cu.to(device))
            hidden = None
            if s > 0:
                hidden = torch.empty(B, T, H, dtype=dtype, device=comm)
                dist.recv(hidden, src=rank_of_stage[s - 1])
                hidden = hidden.to(device)
            out, taps = stage_target.run(ids.to(device), attn.to(device), hidden, segments)
            if not last:
                out = out.to(comm)
                pending.append((out, dist.isend(out, dst=rank_of_stage[s + 1])))
            if taps is not None:
                taps = taps.to(comm)
                pending.append((taps, dist.isend(taps, dst=j)))
            status = _status(stop).to(comm)
            pending.append((status, dist.isend(status, dst=j)))
            served += 1
        for _tensor, work in pending:  # the tensor stays referenced until its send completed
            work.wait()
    return served


class PipelinedTarget:
    """What a drafter rank calls `target`: the target's embedding and LM head held here, its tapped
    hidden states (`context`) computed by the stage ranks. Every other attribute is the Target's."""

    def __init__(self, target, roles: PipelineRoles, rank_of_stage: list[int], device: torch.device, stop):
        self._target, self._roles, self._rank_of_stage, self._device = target, roles, rank_of_stage, device
        self._stop = stop  # this rank's StopFlag: a stage's signal is requested on it
        self._comm = device if dist.get_backend() == "nccl" else torch.device("cpu")
        # the stages that send tapped states, in layer order (each sends its taps concatenated)
        self._senders = list(dict.fromkeys(roles.stage_of_layer(i) for i in target.layer_ids))
        self._widths = {s: sum(1 for i in target.layer_ids if roles.stage_of_layer(i) == s) for s in self._senders}

    def __getattr__(self, name):
        return getattr(self._target, name)

    @torch.no_grad()
    def context(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                segments=None) -> torch.Tensor:
        B, T = input_ids.shape
        attn = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        ids, attn = input_ids.to(self._comm, torch.long), attn.to(self._comm, torch.long)
        wire = [] if segments is None else [t.to(self._comm) for t in _segments_wire(segments)]
        head, sends = _header(B, T, wire[1].numel() if wire else 0).to(self._comm), []
        for r in self._rank_of_stage:
            sends += [dist.isend(t, dst=r) for t in (head, ids, attn, *wire)]
        H, parts = self._target.hidden_size, []
        for s in self._senders:
            part = torch.empty(B, T, self._widths[s] * H, dtype=self._target.dtype, device=self._comm)
            dist.recv(part, src=self._rank_of_stage[s])
            parts.append(part)
        status = torch.zeros(1, dtype=torch.long, device=self._comm)
        for r in self._rank_of_stage:
            dist.recv(status, src=r)
            if int(status.item()) and not self._stop:
                name = signal.Signals(int(status.item())).name
                self._stop.request(name)
                log.warning("%s received by target stage rank %d: finishing the current step, then writing a "
                            "checkpoint", name, r)
        for work in sends:
            work.wait()
        return torch.cat(parts, dim=-1).to(self._device)

    def close(self) -> None:
        """Tell every stage this drafter rank is done, and whether a signal stopped it."""
        for r in self._rank_of_stage:
            dist.send(_header(0, 0, self._stop.status()).to(self._comm), dst=r)


def place(config, d, load, load_items, stop):
    """Split this launch's ranks as --layout pipeline says and load each rank's share of the target.

    `load()` returns the whole Target on the CPU in the run's dtype; the ranks load one after another, so
    the host holds one whole copy at a time. `load_items(target)` reads the training data; every rank
    calls it (the tokenised cache is built by rank 0 behind a barrier of all ranks). A stage rank serves
    the drafter ranks until they finish and returns (None, None, None); a drafter rank returns
    (PipelinedTarget, its Dist within the drafter ranks, the items). `stop` is this rank's StopFlag: a
    stage rank's goes to the drafter ranks with every share, where it sets theirs.
    """
    from dflash.distributed import Dist
    from dflash.io.fit import target_shape
    from dflash.train.parallel.layouts import pipeline_roles

    if config.io.target:  # too many stages for the target's layers: refused before any weight loads
        pipeline_roles(config, d.world_size, target_shape(config.io.target).num_layers)
    target = None
    for r in range(d.world_size):
        if d.rank == r:
            target = load()
        dist.barrier()
    roles = pipeline_roles(config, d.world_size, target.num_layers)
    group = dist.new_group(roles.drafter_ranks)  # every rank takes part in making it
    items = load_items(target)
    rank_of_stage = roles.stage_ranks
    if d.rank in rank_of_stage:
        stage = rank_of_stage.index(d.rank)
        keep_layers(target, range(*roles.stages[stage]), d.device, embed=stage == 0, head=False)
        log.info("rank %d: target layers %d..%d", d.rank, roles.stages[stage][0], roles.stages[stage][1] - 1)
        served = serve_stage(StageTarget(target, roles, stage, d.device), rank_of_stage, roles.drafter_ranks,
                             d.device, target.dtype, stop)
        log.info("rank %d: served %d micro-batch shares", d.rank, served)
        return None, None, None
    keep_layers(target, range(0), d.device, embed=True, head=True)
    mine = Dist(rank=d.rank, world_size=len(roles.drafter_ranks), local_rank=d.local_rank, device=d.device,
                group=group)
    return PipelinedTarget(target, roles, rank_of_stage, d.device, stop), mine, items
