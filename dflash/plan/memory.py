"""Each rank's peak GPU memory for a target, a drafter, a micro-batch, a precision and a --layout.

Notation: P = drafter parameters, U = the largest FSDP unit's parameters (one drafter layer), Wt = the
target's weight bytes (its parameters x the precision's bytes; an FP8 target: 1 byte per quantised weight
+ 4 per 128 x 128 block scale + the rest x e, TargetShape.weight_bytes), e = the precision's bytes (bf16 2,
fp32 4), W = world size. Per rank: B sequences of T tokens, N anchors per sequence, block size bs; Q = N x bs
block rows per sequence, R = B x Q block rows, H the width, L the drafter's layers, V the vocabulary.

Terms (bytes), from the code (dflash.train.step, dflash.model.drafter, dflash.objective.head_loss):
  target_weights      Wt (replicate, shard, offload); a pipeline stage rank: its layers' bytes (TargetShape.layer_bytes)
                      (+ the embedding on stage 0); a pipeline drafter rank: embedding + LM head x e
  drafter_weights     4P fp32 master weights (Drafter is built in fp32; autocast computes in bf16);
                      sharded layouts 4P / D (D: the ranks sharing it); offload: 0 (host memory)
  gradients           4P fp32, held from the backward to the optimizer step; sharded 4P / D; offload 0
  ddp_buckets         replicate at W > 1: DDP's flat gradient buckets, allocated with the wrapper: 4P
  optimizer_state     AdamW exp_avg + exp_avg_sq, fp32: 8P; sharded 8P / D; offload 0
  gathered_units      FSDP2 (shard, offload, pipeline drafter ranks): a unit's full fp32 weights while it
                      runs plus the next one prefetched, and one unit's unsharded gradients before the
                      reduce-scatter: 3 x 4U
  target_forward      the target's forward under no_grad: the tapped states concatenated, [B,T,k*H] in e
                      bytes, twice while the hooks' copies and the concatenation both live, + one layer's
                      working set; modelled as c_target x B x T x H bytes (c_target measured)
  drafter_activations what the drafter's forward keeps for its backward and the fused head's transients,
                      at the worst moment of the step (on the H200 always the end of the forward, with
                      the head's chunks):
                        (c_layer + s) x L' x R x H  +  c_input x r x R x H  +  c_ctx x B x T x H
                        + c_mask x B x Q x (T + Q)  +  c_logit x min(M, 2048) x V
                      (M ~ R x (bs-1)/bs scored rows; 2048: LOSS_CHUNK_ROWS; s: the drafter kind's
                      layer_activation_surplus over DFlash, 0 for DFlash; r of the L layers recomputed in
                      the backward (--recompute-layers) keep only their bf16 input, and L' = L - r layers keep
                      everything, or one while a recomputed layer runs again if r = L). The c are bytes per element,
                      measured on the H200 (bench/bench_plan.py fits them on calibration shapes and checks
                      the model on others); in fp32 every activation byte count doubles.
  weights_in_flight   c_param x P / D: autocast's bf16 copies of the weights during the drafter's step
  cuda_context        the CUDA context and kernels' module images, outside torch's allocator: CONTEXT_GB
  allocator           reserved-but-unallocated blocks of the caching allocator: ALLOCATOR_SLACK x the rest

The peak is the largest of three moments: the target's forward (static terms + target_forward), the
drafter's step (static + weights_in_flight + gathered_units + drafter_activations), the optimizer step
(static + gradients): `rank_peaks` returns each rank's terms at its worst moment. Static: target_weights,
drafter_weights, optimizer_state, ddp_buckets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dflash.config.layout import Layout
from dflash.errors import ConfigError
from dflash.plan.sizes import DrafterShape, TargetShape

GB = 1e9
PRECISIONS = {"bf16": 2, "fp32": 4}
LOSS_CHUNK_ROWS = 2048  # dflash.objective.losses.LOSS_CHUNK_ROWS (not imported: that module pulls torch ops)

# Bytes per element of the activation terms above, bf16 autocast, compiled drafter layers, flex attention,
# fused LM head (the GPU defaults). Fitted (non-negative least squares, bench/bench_plan.py) on the H200,
# 2026-12-04, to the peaks of five compiled calibration steps: a 27B-width target of 8 layers, drafters of
# 2 and 5 layers, 1-2 sequences of 2-8K tokens, 256-1024 anchors (bench/results/h200/plan-validation-run1-*).
# Every calibration peak fell in the drafter's forward with the head's chunks, never in the backward.
COEFFS = {
    "target": 41.8,    # c_target: per token x H during the target's forward (measured 41.81-41.83)
    "layer": 46.5,     # c_layer: per drafter layer x block row x H
    "ctx": 35.1,       # c_ctx: per context token x H (k=5 tapped states in bf16, the fc input, ctx)
    "mask": 0.0,       # c_mask: per element of the [B, Q, T+Q] mask (fitted 0: the dense mask is built and
                       # turned into flex's BlockMask before the layers' activations exist)
    "logit": 5.15,     # c_logit: per element of one [2048, V] chunk of the fused head
    "input": 2.0,      # c_input: per recomputed layer x block row x H (its bf16 input; not fitted: its size)
    "param": 1.61,     # c_param: per drafter parameter (autocast's bf16 weight copies)
}
CONTEXT_GB = 0.8       # CUDA context + module images: device memory in use minus reserved, 0.79-0.80 GB (H200)
ALLOCATOR_SLACK = 0.04  # reserved over allocated at the peak: 1-4 % in 7 of 8 calibration steps (H200)


@dataclass(frozen=True)
class MicroBatch:
    """Per rank: `batch` sequences of `seq_len` tokens, `anchors` anchors per sequence."""

    batch: int
    seq_len: int
    anchors: int

    def __post_init__(self):
        if self.batch < 1 or self.seq_len < 2 or self.anchors < 1:
            raise ConfigError(f"micro-batch {self.batch} x {self.seq_len} with {self.anchors} anchors: need at "
                              "least 1 sequence, 2 tokens and 1 anchor")

    def describe(self) -> str:
        return f"{self.batch} x {self.seq_len}, {self.anchors} anchors/seq"


@dataclass
class RankPeak:
    """One rank's predicted peak: its role, the moment of the peak, and the terms (GB)."""

    role: str
    moment: str
    terms: dict[str, float] = field(default_factory=dict)
    host_gb: float = 0.0   # host memory this rank's share of the drafter state needs (offload)

    @property
    def total_gb(self) -> float:
        return sum(self.terms.values())

    def to_dict(self) -> dict:
        return {"role": self.role, "moment": self.moment, "peak_gb": round(self.total_gb, 2),
                "host_gb": round(self.host_gb, 2), "terms_gb": {k: round(v, 3) for k, v in self.terms.items()}}


def activation_terms(target: TargetShape, drafter: DrafterShape, mb: MicroBatch, precision: str,
                     coeffs: dict | None = None) -> dict[str, float]:
    """The micro-batch's activation bytes (GB): target_forward, drafter_activations (see the module doc)."""
    c = dict(COEFFS, **(coeffs or {}))
    scale = PRECISIONS[precision] / 2  # the coefficients are bf16 bytes
    H, B, T = target.hidden, mb.batch, mb.seq_len
    Q = mb.anchors * drafter.block_size
    R = B * Q
    scored = R * (drafter.block_size - 1) // drafter.block_size
    target_fwd = c["target"] * B * T * H
    r = drafter.recomputed
    kept = max(drafter.layers - r, min(r, 1))  # all recomputed: one layer's activations while it reruns
    drafter_act = ((c["layer"] + drafter.layer_surplus) * kept * R * H + c["input"] * r * R * H
                   + c["ctx"] * B * T * H + c["mask"] * B * Q * (T + Q)
                   + c["logit"] * min(scored, LOSS_CHUNK_ROWS) * target.vocab)
    return {"target_forward": scale * target_fwd / GB, "drafter_activations": scale * drafter_act / GB,
            "weights_in_flight": c["param"] * drafter.params / GB}


def _overheads(terms: dict[str, float]) -> dict[str, float]:
    return {**terms, "allocator": ALLOCATOR_SLACK * sum(terms.values()), "cuda_context": CONTEXT_GB}


def _peak(role: str, static: dict[str, float], grads: float, act: dict[str, float], gathered: float,
          shards: int = 1, with_target_forward: bool = True, host_gb: float = 0.0) -> RankPeak:
    """The worst of the three moments for a rank holding `static` terms (`shards`: ranks sharing the
    drafter's state, whose weight copies and gradients in flight are theirs to share too)."""
    moments = {
        "drafter step": {**static, "weights_in_flight": act["weights_in_flight"] / shards,
                         "gathered_units": gathered, "drafter_activations": act["drafter_activations"]},
        "optimizer step": {**static, "gradients": grads},
    }
    if with_target_forward:
        moments["target forward"] = {**static, "target_forward": act["target_forward"]}
    moment, terms = max(moments.items(), key=lambda kv: sum(kv[1].values()))
    return RankPeak(role=role, moment=moment, terms=_overheads(terms), host_gb=host_gb)


def pipeline_stages(world: int, target_stages: int = 0) -> int:
    """Target stage ranks of --layout pipeline: --target-stages, or half the ranks rounded up."""
    return target_stages or math.ceil(world / 2)


def rank_peaks(target: TargetShape, drafter: DrafterShape, mb: MicroBatch, layout: str, world: int = 1,
               precision: str = "bf16", target_stages: int = 0, coeffs: dict | None = None) -> list[RankPeak]:
    """Each distinct rank role's predicted peak under `layout` at world size `world` (one RankPeak per role:
    every rank of a role peaks the same)."""
    spec = Layout.of(layout)
    if precision not in PRECISIONS:
        raise ConfigError(f"precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    if world < 1:
        raise ConfigError(f"world size {world}: need at least 1 process")
    c = dict(COEFFS, **(coeffs or {}))
    e, P, U = PRECISIONS[precision], drafter.params, drafter.unit_params
    act = activation_terms(target, drafter, mb, precision, c)
    target_w = target.weight_bytes(e) / GB
    if not spec.shards_drafter:
        static = {"target_weights": target_w, "drafter_weights": 4 * P / GB, "optimizer_state": 8 * P / GB}
        if world > 1:  # DDP's reducer allocates its gradient buckets once, beside the gradients
            static["ddp_buckets"] = 4 * P / GB
        return [_peak("every rank", static, 4 * P / GB, act, 0.0)]
    if not spec.target_in_stages:
        gathered = 3 * 4 * U / GB
        if not spec.state_on_host:
            static = {"target_weights": target_w, "drafter_weights": 4 * P / world / GB,
                      "optimizer_state": 8 * P / world / GB}
            return [_peak("every rank", static, 4 * P / world / GB, act, gathered, shards=world)]
        static = {"target_weights": target_w}
        return [_peak("every rank", static, 0.0, act, gathered, shards=world, host_gb=16 * P / world / GB)]
    # pipeline: S stage ranks hold contiguous target layers; the other D ranks hold the embedding, the LM
    # head and the drafter sharded among themselves, and get the tapped states by point-to-point sends.
    S = pipeline_stages(world, target_stages)
    D = world - S
    if world < 2 or D < 1:
        raise ConfigError(f"--layout pipeline needs a rank for the drafter beside the target's stages: world size "
                          f"{world} with {S} stage ranks leaves {max(D, 0)}; use 2 or more processes, fewer "
                          "--target-stages, or --layout offload on one card")
    if S > target.layers:
        raise ConfigError(f"{S} target stages for a {target.layers}-layer target; use at most {target.layers}")
    base, extra = divmod(target.layers, S)
    sizes = [base + (1 if s < extra else 0) for s in range(S)]
    layer_b, start, stage_bytes = target.layer_bytes(e), 0, []
    for n in sizes:
        stage_bytes.append(sum(layer_b[start:start + n]) / GB)
        start += n
    embed, head = target.embed_params * e / GB, (target.head_params or target.embed_params) * e / GB
    # a stage keeps its incoming hidden states [B,T,H] and the tapped states it sends [B,T,k*H] (e bytes)
    # beside one layer's working set: target_forward at its own share of the tapped layers.
    sends = mb.batch * mb.seq_len * target.hidden * e * (1 + drafter.tapped) / GB
    first = RankPeak(role=f"target stage 0 ({sizes[0]} layers + embedding)", moment="target forward",
                     terms=_overheads({"target_weights": stage_bytes[0] + embed, "target_forward": act["target_forward"],
                                       "sends": sends}))
    widest = max(range(S), key=lambda s: stage_bytes[s])
    peaks = [first]
    if S > 1:
        peaks.append(RankPeak(role=f"target stage {widest or 1} ({sizes[widest or 1]} layers)",
                              moment="target forward",
                              terms=_overheads({"target_weights": stage_bytes[widest or 1],
                                                "target_forward": act["target_forward"], "sends": sends})))
    static = {"target_weights": embed + head, "drafter_weights": 4 * P / D / GB, "optimizer_state": 8 * P / D / GB}
    peaks.append(_peak(f"drafter rank ({D} sharing the drafter)", static, 4 * P / D / GB, act, 3 * 4 * U / GB,
                       shards=D, with_target_forward=False))
    return peaks


def worst(peaks: list[RankPeak]) -> RankPeak:
    return max(peaks, key=lambda p: p.total_gb)
