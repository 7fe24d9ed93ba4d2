"""GatedDeltaNet kernel benchmark: the fast kernels vs transformers' torch fallbacks, side by side in one run.

    python bench/bench_kernels.py                      (make bench-kernels; needs a GPU for the fast paths)
    python bench/bench_kernels.py --json out.json --layers 3:1 --seq-len 4096

Part 1, one function at a time (bf16, CUDA events, median of --reps after warm-up):
  causal_conv1d_fn       causal-conv1d's CUDA kernel  vs transformers' F.conv1d fallback
  causal_conv1d_update   causal-conv1d's CUDA kernel  vs transformers' torch fallback (one decode step)
  chunk_gated_delta_rule fla's Triton kernels         vs transformers' torch_chunk_gated_delta_rule
Part 2, a stack of Qwen3.5-27B-sized decoder layers (hidden 5120; GatedDeltaNet with 16 key / 48 value
heads of 128; full attention 24 / 4 heads of 256; MLP 17408; random bf16 weights), forward over
--seq-len tokens, in three modes that switch transformers' per-function dispatch:
  all fast       causal-conv1d + fla
  fla only       the conv falls back to F.conv1d (what a runtime without the causal-conv1d wheel runs)
  all fallbacks  no fla, no causal-conv1d
Each mode's output is compared with the all-fallbacks output (relative error), so a fast path that
computes something else cannot look fast. Without a GPU only the fallback columns run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from dflash.doctor.numerics import rel_error
from dflash.model.kernels import kernel_functions
from dflash.train.probes.timing import timed

MODES = {"all fast": {"fla", "causal_conv1d"}, "fla only": {"fla"}, "all fallbacks": set()}


class Dispatch:
    """transformers' Qwen3.5 kernel functions, switchable between their fast and torch implementations."""

    def __init__(self):
        import transformers.models.qwen3_5.modeling_qwen3_5 as module

        self.module = module
        self.functions = {fn.name: (fn, getattr(module, fn.attr)) for fn in kernel_functions(module)}
        if not self.functions:
            raise SystemExit("transformers' Qwen3.5 module defines no per-function kernel dispatch "
                             "(transformers < 5.15?); install the pinned transformers (locks/)")

    def fast_available(self, package: str) -> bool:
        return all(fn.fast for fn, _ in self.functions.values() if fn.package == package)

    def use(self, fast_packages: set[str]) -> None:
        for fn, wrapper in self.functions.values():
            setattr(self.module, fn.attr, wrapper if fn.package in fast_packages and fn.fast else fn.torch_function)

    def impl(self, name: str, fast: bool):
        fn, wrapper = self.functions[name]
        return wrapper if fast else fn.torch_function

    def restore(self) -> None:
        for fn, wrapper in self.functions.values():
            setattr(self.module, fn.attr, wrapper)


def bench_functions(d: Dispatch, device, dtype, args) -> list[dict]:
    rows = []
    gpu = device.type == "cuda"
    B, D, L, W = 2, args.conv_dim, args.seq_len, 4
    x = torch.randn(B, D, L, device=device, dtype=dtype)
    weight = (torch.randn(D, W, device=device) / W).to(dtype)
    x1 = torch.randn(args.decode_batch, D, 1, device=device, dtype=dtype)
    state = torch.randn(args.decode_batch, D, W - 1, device=device, dtype=dtype)

    Hk, Hv, K = 16, 48, 128
    T = args.seq_len
    q = F.normalize(torch.randn(1, T, Hk, K, device=device, dtype=torch.float32), dim=-1).to(dtype)
    k = F.normalize(torch.randn(1, T, Hk, K, device=device, dtype=torch.float32), dim=-1).to(dtype)
    v = torch.randn(1, T, Hv, K, device=device, dtype=dtype)
    g = -F.softplus(torch.randn(1, T, Hv, device=device, dtype=torch.float32))
    beta = torch.sigmoid(torch.randn(1, T, Hv, device=device)).to(dtype)

    cases = [
        ("causal_conv1d_fn", "causal_conv1d", f"B={B} D={D} L={L} W={W}",
         lambda f: f(x, weight, None, activation="silu")),
        ("causal_conv1d_update", "causal_conv1d", f"B={args.decode_batch} D={D} one step",
         lambda f: f(x1, state.clone(), weight, None, "silu")),
        ("chunk_gated_delta_rule", "fla", f"T={T} q/k {Hk}x{K} v {Hv}x{K}",
         lambda f: f(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)),
    ]
    for name, package, shape, call in cases:
        row = {"function": name, "shape": shape}
        ref = call(d.impl(name, False))
        ref = ref[0] if isinstance(ref, tuple) else ref
        row["fallback_ms"] = timed(lambda: call(d.impl(name, False)), device, args.reps)
        if gpu and d.fast_available(package):
            out = call(d.impl(name, True))
            out = out[0] if isinstance(out, tuple) else out
            row["rel_err_vs_fallback"] = rel_error(out, ref.double())
            row["fast_ms"] = timed(lambda: call(d.impl(name, True)), device, args.reps)
            row["speedup"] = row["fallback_ms"] / row["fast_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def layer_stack(args, device, dtype):
    """A Qwen3.5 decoder of --layers (GatedDeltaNet:attention) at Qwen3.5-27B's layer sizes."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel

    n_gdn, n_attn = (int(v) for v in args.layers.split(":"))
    per = max(1, n_gdn // max(1, n_attn))
    types = []
    while len(types) < n_gdn + n_attn:  # the real model's rhythm: `per` GatedDeltaNet layers, then attention
        types += ["linear_attention"] * min(per, n_gdn - types.count("linear_attention"))
        if types.count("full_attention") < n_attn:
            types.append("full_attention")
    H = args.hidden
    config = Qwen3_5TextConfig(
        vocab_size=256, hidden_size=H, intermediate_size=args.intermediate, num_hidden_layers=len(types),
        layer_types=types, num_attention_heads=24 * H // 5120 or 1, num_key_value_heads=4 * H // 5120 or 1,
        head_dim=256, linear_num_key_heads=16 * H // 5120 or 1, linear_num_value_heads=48 * H // 5120 or 1,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3_5TextModel._from_config(config, dtype=dtype).eval().requires_grad_(False)
    return model, types


def bench_stack(d: Dispatch, device, dtype, args) -> list[dict]:
    model, types = layer_stack(args, device, dtype)
    label = f"{types.count('linear_attention')} GatedDeltaNet + {types.count('full_attention')} attention"
    torch.manual_seed(1)
    x = torch.randn(1, args.seq_len, args.hidden, device=device, dtype=dtype)
    outputs, rows = {}, []
    for mode, packages in MODES.items():
        if device.type != "cuda" and packages:
            continue
        if any(not d.fast_available(p) for p in packages):
            rows.append({"mode": mode, "layers": label, "skipped": f"not installed: {sorted(packages)}"})
            print(json.dumps(rows[-1]), flush=True)
            continue
        d.use(packages)
        with torch.no_grad():
            run = lambda: model(inputs_embeds=x, use_cache=False).last_hidden_state  # noqa: E731
            outputs[mode] = run().double()
            ms = timed(run, device, args.reps)
        rows.append({"mode": mode, "layers": label, "T": args.seq_len, "ms": ms,
                     "tokens_per_s": args.seq_len / ms * 1e3})
        print(json.dumps(rows[-1]), flush=True)
    d.restore()
    base = outputs.get("all fallbacks")
    for row in rows:
        if base is not None and row["mode"] in outputs:
            row["rel_err_vs_fallbacks"] = rel_error(outputs[row["mode"]], base)
        if "ms" in row and rows[-1].get("ms"):
            row["vs_all_fallbacks"] = rows[-1]["ms"] / row["ms"]
    return rows


def report(functions: list[dict], stack: list[dict], device: str, dtype: str = "bf16") -> str:
    lines = [f"kernels on {device} ({dtype}, median ms)", f"{'function':<24} {'shape':<28} {'fast':>8} {'fallback':>9} "
             f"{'speedup':>8} {'rel err':>8}"]
    for r in functions:
        fast = f"{r['fast_ms']:.3f}" if "fast_ms" in r else "-"
        sp = f"{r['speedup']:.1f}x" if "speedup" in r else "-"
        err = f"{r['rel_err_vs_fallback']:.1e}" if "rel_err_vs_fallback" in r else "-"
        lines.append(f"{r['function']:<24} {r['shape']:<28} {fast:>8} {r['fallback_ms']:>9.3f} {sp:>8} {err:>8}")
    if stack:
        lines += ["", f"Qwen3.5-27B-sized layers ({stack[0]['layers']}), forward"]
        lines.append(f"{'mode':<14} {'ms':>8} {'tok/s':>9} {'vs fallbacks':>13} {'rel err':>8}")
        for r in stack:
            if "skipped" in r:
                lines.append(f"{r['mode']:<14} skipped: {r['skipped']}")
                continue
            err = f"{r['rel_err_vs_fallbacks']:.1e}" if "rel_err_vs_fallbacks" in r else "-"
            lines.append(f"{r['mode']:<14} {r['ms']:>8.2f} {r['tokens_per_s']:>9.0f} {r.get('vs_all_fallbacks', 1):>12.2f}x {err:>8}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="'auto' (cuda if there), 'cpu', 'cuda'")
    p.add_argument("--seq-len", type=int, default=None, help="tokens (default: 4096 GPU, 64 CPU)")
    p.add_argument("--hidden", type=int, default=None, help="layer width (default: 5120 GPU = Qwen3.5-27B, 320 CPU)")
    p.add_argument("--intermediate", type=int, default=None, help="MLP width (default: 17408 GPU, 1088 CPU)")
    p.add_argument("--layers", default="3:1", help="GatedDeltaNet:attention layers of the stack")
    p.add_argument("--conv-dim", type=int, default=None, help="conv channels (default: 10240 GPU = 27B's q+k+v, 256 CPU)")
    p.add_argument("--decode-batch", type=int, default=64, help="sequences in the causal_conv1d_update step")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default: 20 GPU, 2 CPU)")
    p.add_argument("--skip-stack", action="store_true", help="only the per-function part")
    p.add_argument("--json", help="also write the results to this JSON file")
    args = p.parse_args(argv)
    gpu = (args.device == "auto" and torch.cuda.is_available()) or args.device.startswith("cuda")
    device = torch.device("cuda" if gpu else "cpu")
    for key, on_gpu, on_cpu in (("seq_len", 4096, 64), ("hidden", 5120, 320), ("intermediate", 17408, 1088),
                                ("conv_dim", 10240, 256), ("reps", 20, 2)):
        if getattr(args, key) is None:
            setattr(args, key, on_gpu if gpu else on_cpu)
    dtype = torch.bfloat16 if gpu else torch.float32
    d = Dispatch()
    name = torch.cuda.get_device_name(device) if gpu else "cpu"
    functions = bench_functions(d, device, dtype, args)
    stack = [] if args.skip_stack else bench_stack(d, device, dtype, args)
    print("\n" + report(functions, stack, name, str(dtype).removeprefix("torch.")))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "torch": torch.__version__, "functions": functions,
                                               "stack": stack}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
