"""What one speculative-decoding step costs on a target of a preset shape, and the speed-up that bounds.

    python bench/bench_spec_step.py --preset 27b                 (one H200: random Qwen3.5-27B target, bf16)
    python bench/bench_spec_step.py --preset tiny --device cpu   (make bench-spec-step PRESET=tiny)

The target is a random Qwen3.5 hybrid of the preset's shape (dflash.model.shapes.random_target, built on
the device; bf16 on a GPU, fp32 on a CPU), the drafter a random one of the reference shape (27b: hidden
5120, 5 layers, 32 heads x 128, 8 KV heads, intermediate 17408, block 16, tapped layers [1,16,31,46,61]).
After a prefill of --prefill tokens through dflash.decode.target_state.TargetCache, each step below is timed
(CUDA events on a GPU, perf_counter on a CPU; median of --reps after --warmup untimed calls) with the
functions dflash.decode.spec_decode calls, in its order:

  verify, accept all    TargetCache.forward([anchor, d1..d15], rollback_ready=True) (the tapped states
                        the drafter needs come out of the same pass), target.lm_head over the 16
                        positions, argmax, accept_greedy, rollback(16) (nothing to undo)
  verify, reject half   the same, then rollback(8): attention KV cropped, GatedDeltaNet states restored
                        and re-advanced over the 8 kept tokens
  draft                 DrafterProposer.propose with its incremental context: the 16 newly accepted
                        positions' tapped states into the drafter's context cache, one drafter pass over
                        the block, target.lm_head over the 15 draft positions, argmax
  greedy                TargetCache.forward of 1 token, target.lm_head, argmax (target_generate's step)

Tokens are random (costs do not depend on them); the caches keep growing over the repetitions (by at
most a few hundred tokens past the prefill), as in decoding. One speculative step costs t_verify + t_draft
and yields tau tokens on average; greedy decoding yields one token per t_greedy, so

    speedup(tau) ≈ tau × t_greedy / (t_verify + t_draft)

an upper bound that leaves out the loop's Python bookkeeping; it is printed for tau in --taus with
t_verify = the reject-half time (a step with tau < 16 nearly always rejects part of its block) and with
the accept-all time.
"""

from __future__ import annotations

import argparse
import sys

import torch

from dflash.decode.evaluate import untrained_drafter
from dflash.decode.proposers import DrafterProposer, Sampler
from dflash.decode.spec_decode import accept_greedy
from dflash.decode.target_state import TargetCache
from dflash.kinds import DEFAULT, named, names
from dflash.model.target import Target
from dflash.model.shapes import QWEN35_27B, random_target
from dflash.train.probes.timing import timed

# target shape (dflash.model.shapes' keys), drafter shape (DrafterConfig overrides), tapped layers
PRESETS = {
    "27b": (QWEN35_27B,
            dict(num_hidden_layers=5, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 intermediate_size=17408, block_size=16),
            [1, 16, 31, 46, 61]),
    "tiny": (dict(hidden=64, layers=4, vocab=512, intermediate=128, heads=4, kv_heads=2, head_dim=32,
                  linear_k_heads=2, linear_v_heads=4),
             dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=128, block_size=16),
             [1]),
}


def build(preset: str, device: torch.device, dtype: torch.dtype, kind: str = DEFAULT):
    shape, drafter_shape, layer_ids = PRESETS[preset]
    built = random_target(shape, device, dtype)
    target = Target(built.model, built.tokenizer, layer_ids=layer_ids, mask_token=2)
    config = named(kind).config_class.from_target(target, **drafter_shape)  # dflash2: 16-channel groups, r 256, K 16
    with torch.device(device):
        drafter = untrained_drafter(target, config)
    return target, DrafterProposer(drafter)


def measure(target, proposer: DrafterProposer, prefill: int, reps: int, warmup: int) -> dict:
    """Median milliseconds of each step (module docstring)."""
    device, bs, sampler = target.device, proposer.block_size, Sampler()
    g = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, target.vocab_size, (n,), generator=g).tolist()

    runner = TargetCache.create(target)
    if runner is None:
        raise SystemExit(f"no exact target cache: {TargetCache.unsupported_reason(target)}")
    prompt = tokens(prefill)
    last, prompt_context = runner.forward(prompt)                        # the prefill (untimed)
    anchor = int(sampler.pick(target.lm_head(last[0, -1:]))[0])

    def greedy():
        last, _ = runner.forward([anchor])
        return int(sampler.pick(target.lm_head(last[0, -1:]))[0])

    draft = tokens(bs - 1)

    def verify(keep: int):
        last, context = runner.forward([anchor] + draft, rollback_ready=True)
        accept_greedy(draft, target.lm_head(last[0]).argmax(-1).tolist())
        runner.rollback(keep)                    # forced: random drafts would keep only the anchor
        return context[:, :keep]                 # the kept positions' tapped states, for the drafter

    ms = {"greedy": timed(greedy, device, reps, warmup),
          "verify, accept all": timed(lambda: verify(bs), device, reps, warmup),
          "verify, reject half": timed(lambda: verify(bs // 2), device, reps, warmup)}

    ids = prompt + [anchor]
    proposer.begin()
    proposer.propose(target, ids, prompt_context, sampler)              # the drafter's prefill (untimed)
    new_context = runner.forward([anchor] + draft)[1]                   # 16 accepted positions' tapped states

    def propose():
        ids.extend(draft + [anchor])
        return proposer.propose(target, ids, new_context, sampler).tokens

    ms["draft"] = timed(propose, device, reps, warmup)
    return ms


def report(ms: dict, taus: list[float]) -> str:
    lines = [f"{'step':<22} {'ms':>9}"] + [f"{name:<22} {v:>9.3f}" for name, v in ms.items()]
    greedy, draft = ms["greedy"], ms["draft"]
    lines += ["", "speedup(tau) ≈ tau × t_greedy / (t_verify + t_draft)",
              f"{'tau':>5} {'t_verify = reject half':>23} {'t_verify = accept all':>22}"]
    for tau in taus:
        lines.append(f"{tau:>5g} {tau * greedy / (ms['verify, reject half'] + draft):>22.2f}x "
                     f"{tau * greedy / (ms['verify, accept all'] + draft):>21.2f}x")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", default="27b", choices=sorted(PRESETS), help="target + drafter shape")
    p.add_argument("--device", default="auto", help="'auto' (cuda if there), 'cpu', 'cuda'")
    p.add_argument("--prefill", type=int, default=4096, help="tokens in the target's cache before the steps")
    p.add_argument("--reps", type=int, default=10, help="timed calls per step")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per step first")
    p.add_argument("--taus", default="3,5,7", help="comma list of tau for the speed-up bound")
    p.add_argument("--drafter-kind", default=DEFAULT, choices=names(),
                   help="dflash2: the draft step adds the convolutions and the selector's greedy walk")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    gpu = (args.device == "auto" and torch.cuda.is_available()) or args.device.startswith("cuda")
    device = torch.device("cuda" if args.device == "auto" else args.device) if gpu else torch.device("cpu")
    if gpu:  # "cuda" alone means the current device; set_device needs an index
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if gpu else torch.float32
    where = torch.cuda.get_device_name(device) if gpu else f"CPU ({torch.get_num_threads()} threads)"
    print(f"torch {torch.__version__}, {where}, {dtype}", flush=True)
    target, proposer = build(args.preset, device, dtype, args.drafter_kind)
    c = proposer.drafter.config
    print(f"target {args.preset}: {sum(p.numel() for p in target.model.parameters()) / 1e6:,.1f}M params, "
          f"{target.num_layers} layers, hidden {target.hidden_size}, vocab {target.vocab_size}, tapped "
          f"{target.layer_ids}; drafter {sum(p.numel() for p in proposer.drafter.parameters()) / 1e6:,.1f}M "
          f"params, {c.num_hidden_layers} layers, {c.num_attention_heads}x{c.head_dim} heads, "
          f"{c.num_key_value_heads} KV, intermediate {c.intermediate_size}, block {c.block_size}; "
          f"prefill {args.prefill}; kernels {target.kernel_report() or '-'}", flush=True)
    ms = measure(target, proposer, args.prefill, args.reps, args.warmup)
    if gpu:
        print(f"peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB")
    print(report(ms, [float(t) for t in args.taus.split(",") if t.strip()]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
