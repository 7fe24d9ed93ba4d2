"""Predicted tokens/s of a layout: the H200's measured phase costs, scaled by FLOPs, the card's bf16 peak and
each layout's transfers.

Measured on one H200 at the 27B shape (2 x 4096 tokens, 512 anchors per sequence, 5-layer drafter, the
current step: docs/performance.md): target forward 0.826 s, drafter forward 0.252 s, drafter backward
0.300 s, AdamW 0.016 s per micro-batch. A phase's time elsewhere is

    t = t_H200 x (FLOPs of this shape / FLOPs of the measured shape) x (H200 bf16 peak / card bf16 peak)

(FLOPs from dflash.train.probes.mfu's formulas: the target's forward, the drafter's and the LM head's), and
the AdamW step scales with the parameters it updates (per rank). On top, per layout (none of these
overheads is measured yet; each is the time of its transfers, `collective_s` for the collectives):
  replicate   W > 1: DDP's all-reduce of 4P bytes of gradients in buckets of 25 MiB, overlapped with the
              backward: only what exceeds the backward counts
  shard       the same bytes as all-gathers (forward and backward) and a reduce-scatter, one of each per
              FSDP unit (each drafter layer and the root), overlapped with the drafter's forward + backward
  offload     shard's collectives, and every step copies the weights up twice and the gradients down over the
              host link (3 x 4P / W / host link), overlapped likewise; AdamW runs on the CPU (P / W x 28 bytes
              read and written / host memory bandwidth)
  pipeline    S stages each run 1/S of the target's forward; D drafter ranks run the drafter (shard's
              collectives among them); each stage sends [B,T,H] onward and its tapped states [B,T,k*H] to a
              drafter rank. A step of m micro-batches (--micro-batches) takes (m + S - 1) x the slowest
              stage's time (GPipe's bubble), and the drafter ranks take m / D micro-batches each; tokens/s =
              m x tokens / the slower side.

A collective over W ranks runs as a ring (NCCL's algorithm for large messages): an all-reduce of B bytes
moves 2 (W-1)/W x B per rank at the slowest link of the ring, an all-gather or reduce-scatter (W-1)/W x B,
and each of its 2 (W-1) or W-1 steps first waits a hop's latency (STEP_LATENCY_S). The link is the card's
GPU-to-GPU link (CARDS: NVLink, or PCIe) while the W ranks fit one node (GPUS_PER_NODE cards); beyond it the
ring crosses the network between nodes, NETWORK_GBPS per GPU. These rates are data-sheet figures, not
measurements, so `dflash plan` says what it assumed whenever it predicts for more than one GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dflash.config.layout import Layout
from dflash.plan.memory import MicroBatch, pipeline_stages
from dflash.plan.sizes import DrafterShape, TargetShape

H200_PHASES = {"target forward": 0.826, "drafter forward": 0.252, "drafter backward": 0.300, "optimizer": 0.016}
REFERENCE = dict(batch=2, seq_len=4096, anchors=512)  # the micro-batch the phases were measured on


@dataclass(frozen=True)
class Card:
    name: str
    memory_gb: float         # what torch sees (10^9 bytes): the "141 GB" H200 reports 150.1
    bf16_tflops: float       # dense bf16 tensor-core peak (data sheet)
    link_gbps: float         # GPU-to-GPU, GB/s one way (NVLink, or PCIe where cards have no NVLink)
    host_gbps: float = 25.0  # host <-> GPU copies of pinned memory, GB/s
    host_mem_gbps: float = 40.0  # host memory bandwidth available to the CPU AdamW step, GB/s


# Memory as torch.cuda.mem_get_info reports it (10^9 bytes; the names say GiB): H200 143,771 MiB (150.1 GB
# total on the H200 measured here), RTX PRO 6000 Blackwell 96 GiB (102 GB, the cap the issue measured
# with), RTX 5090 32 GiB less the driver's share (32,607 MiB: 34.2 GB).
CARDS = {
    "h200": Card("H200 141 GB", 150.1, 989.0, 450.0, host_gbps=50.0),
    "rtx-pro-6000": Card("RTX PRO 6000 96 GB", 102.0, 504.0, 50.0),
    "rtx-5090": Card("RTX 5090 32 GB", 34.2, 209.0, 50.0),
}
H200 = CARDS["h200"]

# The collectives of a run of several GPUs (module docstring): assumptions, stated in every multi-GPU plan.
GPUS_PER_NODE = 8          # cards that share one node's GPU links (an HGX board, a PCIe server of 8 cards)
NETWORK_GBPS = 50.0        # between nodes, per GPU and one way: one 400 Gb/s InfiniBand or RoCE port per GPU
STEP_LATENCY_S = 10e-6     # what each step of a ring collective waits before its bytes move (NCCL, one hop)
DDP_BUCKET_BYTES = 25 * 2**20  # DDP's gradient bucket (bucket_cap_mb 25): one all-reduce per bucket


def _target_flops(target: TargetShape, mb: MicroBatch) -> float:
    """dflash.train.probes.mfu.target_forward_flops on full sequences of mb.seq_len."""
    pairs = mb.batch * mb.seq_len * (mb.seq_len + 1) / 2
    return 2 * sum(target.layer_params) * mb.batch * mb.seq_len + 4 * target.head_dim * target.heads * pairs \
        * target.full_attention_layers


def _drafter_flops(target: TargetShape, drafter: DrafterShape, mb: MicroBatch, head: bool = True) -> float:
    """dflash.model.flops.drafter_flops + head_flops (`head` False: without the head), anchors spread evenly
    over the second half of each sequence (the supervised half of dflash.train.probes.synthetic's items)."""
    from dflash.model.flops import drafter_flops, head_flops

    bs, n = drafter.block_size, mb.anchors
    mean_anchor = 0.75 * mb.seq_len
    pairs = mb.batch * bs * (n * mean_anchor + bs * n)
    rows = mb.batch * n * bs
    layers = drafter_flops(drafter.config, mb.batch * mb.seq_len, rows, pairs)
    return layers + head_flops(drafter.config, rows * (bs - 1) // bs) if head else layers


def phase_times(target: TargetShape, drafter: DrafterShape, mb: MicroBatch, card: Card, shards: int = 1) -> dict:
    """Seconds per micro-batch of each phase on one `card`, for this shape (AdamW over P / shards)."""
    from dflash.plan.sizes import drafter_shape, preset_shape

    ref_target = preset_shape("27b")
    ref_drafter = drafter_shape(ref_target)
    ref_mb = MicroBatch(**REFERENCE)
    speed = H200.bf16_tflops / card.bf16_tflops
    t_scale = _target_flops(target, mb) / _target_flops(ref_target, ref_mb)
    drafter_f = _drafter_flops(target, drafter, mb)
    d_scale = drafter_f / _drafter_flops(ref_target, ref_drafter, ref_mb)
    # AdamW is memory-bound: bytes over the card's bandwidth; scaled here by the parameters alone
    o_scale = drafter.params / shards / ref_drafter.params
    forward = H200_PHASES["drafter forward"] * d_scale * speed
    rerun = 0.0  # --recompute-layers: the backward runs r of the L layers forward again (their share of it)
    if drafter.recomputed:
        layers_f = _drafter_flops(target, drafter, mb, head=False)
        rerun = forward * layers_f / drafter_f * drafter.recomputed / drafter.layers
    return {"target forward": H200_PHASES["target forward"] * t_scale * speed,
            "drafter forward": forward,
            "drafter backward": H200_PHASES["drafter backward"] * d_scale * speed + rerun,
            "optimizer": H200_PHASES["optimizer"] * o_scale * speed}


def ring_gbps(card: Card, world: int) -> float:
    """GB/s of the slowest link of a ring over `world` ranks: the card's own link within one node, the
    network between nodes beyond it (whichever is slower)."""
    return card.link_gbps if world <= GPUS_PER_NODE else min(card.link_gbps, NETWORK_GBPS)


def collective_s(kind: str, nbytes: float, world: int, card: Card, calls: int = 1) -> float:
    """Seconds of ring collectives over `world` ranks moving `nbytes` in all (the full, unsharded size), in
    `calls` collectives: kind "all-reduce" (2 (W-1) steps) or "all-gather" / "reduce-scatter" (W-1 steps)."""
    if world <= 1 or nbytes <= 0:
        return 0.0
    steps = 2 * (world - 1) if kind == "all-reduce" else world - 1
    return steps / world * nbytes / (ring_gbps(card, world) * 1e9) + calls * steps * STEP_LATENCY_S


def _sharded_collectives_s(drafter: DrafterShape, world: int, card: Card) -> float:
    """FSDP2 over `world` ranks: per unit (each drafter layer and the root) an all-gather of its fp32 weights in
    the forward, another in the backward, and a reduce-scatter of its gradients."""
    units, nbytes = drafter.layers + 1, 4 * drafter.params
    return (2 * collective_s("all-gather", nbytes, world, card, calls=units)
            + collective_s("reduce-scatter", nbytes, world, card, calls=units))


def communication_note(card: Card, world: int) -> str | None:
    """What a prediction for `world` GPUs assumed of their links (None for one GPU), for the plan's output."""
    if world <= 1:
        return None
    if world <= GPUS_PER_NODE:
        links = f"one node, over the {card.name}'s GPU-to-GPU link at {card.link_gbps:g} GB/s"
    else:
        links = (f"{math.ceil(world / GPUS_PER_NODE):,} nodes of {GPUS_PER_NODE} GPUs, whose slowest link is the "
                 f"network between nodes at {ring_gbps(card, world):g} GB/s per GPU")
    return (f"tokens/s for {world:,} GPUs counts the drafter's collectives (replicate: the gradient all-reduce; "
            "shard, offload, pipeline: the all-gathers and reduce-scatters; 4 bytes per parameter) as rings over "
            f"{links}, {STEP_LATENCY_S * 1e6:g} us per ring step, where they outlast the drafter's compute. "
            "These rates are assumed, not measured"
            + ("; beyond one node neither the network's topology nor congestion nor stragglers are modelled, "
               "so read the figure as an upper bound." if world > GPUS_PER_NODE else "."))


def tokens_per_second(target: TargetShape, drafter: DrafterShape, mb: MicroBatch, layout: str, world: int,
                      card: Card, target_stages: int = 0, micro_batches: int = 4) -> dict:
    """{"tokens_per_s": all ranks together, "step_s": seconds per micro-batch per rank, "phases": {...},
    "overhead_s": the layout's transfers that are not hidden}."""
    tokens = mb.batch * mb.seq_len
    P = drafter.params
    spec = Layout.of(layout)
    if spec.target_in_stages:
        S = pipeline_stages(world, target_stages)
        D = world - S
        t = phase_times(target, drafter, mb, card, shards=D)
        send = tokens * target.hidden * 2 * (1 + drafter.tapped) / (ring_gbps(card, world) * 1e9)
        stage = t["target forward"] / S + send
        gather = _sharded_collectives_s(drafter, D, card)
        drafter_side = t["drafter forward"] + t["drafter backward"] + max(0.0, gather - t["drafter backward"])
        m = micro_batches
        step = max((m + S - 1) * stage, math.ceil(m / D) * drafter_side) + t["optimizer"]
        return {"tokens_per_s": m * tokens / step, "step_s": step / m, "phases": t,
                "overhead_s": (S - 1) * stage / m + send}
    shards = world if spec.shards_drafter else 1
    t = phase_times(target, drafter, mb, card, shards=shards)
    compute = sum(t.values())
    if not spec.shards_drafter:
        comm = collective_s("all-reduce", 4 * P, world, card, calls=math.ceil(4 * P / DDP_BUCKET_BYTES))
        overhead = max(0.0, comm - t["drafter backward"])
    elif not spec.state_on_host:
        comm = _sharded_collectives_s(drafter, world, card)
        overhead = max(0.0, comm - t["drafter forward"] - t["drafter backward"])
    else:  # offload: shard's collectives, the host link and the CPU's AdamW, per rank's shard
        comm = _sharded_collectives_s(drafter, world, card)
        copies = 3 * 4 * P / world / (card.host_gbps * 1e9)
        cpu_adam = 28 * P / world / (card.host_mem_gbps * 1e9)
        overhead = (max(0.0, comm + copies - t["drafter forward"] - t["drafter backward"]) + cpu_adam
                    - t["optimizer"])
    step = compute + overhead
    return {"tokens_per_s": world * tokens / step, "step_s": step, "phases": t, "overhead_s": overhead}
