"""Float64 references for the GatedDeltaNet kernels, and the doctor's GPU numerics check (docs/architecture.md, "The doctor's checks", 5).

The references are written from the definitions, as plain loops, so they share no code with the
kernels or with transformers' fallbacks:

  causal conv1d, width W, per channel d (x[t] = 0 for t < 0):
      out[b, d, t] = act( bias[d] + sum_{w=0}^{W-1} weight[d, w] * x[b, d, t - (W-1) + w] )

  gated delta rule, per batch b and head h, state S of shape (K, V), S_0 = initial state:
      S'   = exp(g_t) * S_{t-1}                       decay
      u_t  = beta_t * (v_t - S'^T k_t)                 delta: what the state mispredicts for k_t
      S_t  = S' + k_t u_t^T                            rank-1 write
      o_t  = S_t^T (scale * q_t)                       read

The check runs the real kernels in bf16 on fresh random inputs, on every visible GPU, and compares
with the references by relative error ||out - ref|| / ||ref||. NaN or inf never passes, and every
output buffer is poisoned with NaN first, so a kernel that writes nothing cannot pass on stale memory.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

RTOL = 1e-2  # bf16 keeps 8 mantissa bits: ~4e-3 per rounding; 1e-2 leaves room for accumulation


# ----------------------------------------------------------------------------------------------------
# References (float64, CPU or GPU)
# ----------------------------------------------------------------------------------------------------
def _act(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation in (None, "identity"):
        return x
    if activation in ("silu", "swish"):
        return x * torch.sigmoid(x)
    raise ValueError(f"activation '{activation}' is not one of None, 'silu', 'swish'.")


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      activation: str | None = None) -> torch.Tensor:
    """Depthwise causal conv. x (B, D, L), weight (D, W), bias (D,) -> out (B, D, L), float64."""
    B, D, L = x.shape
    W = weight.shape[1]
    xp = F.pad(x.double(), (W - 1, 0))  # (B, D, W-1+L): W-1 zeros before t = 0
    w = weight.double()
    out = torch.zeros(B, D, L, dtype=torch.float64, device=x.device)
    for tap in range(W):  # tap w looks back W-1-w steps
        out += w[None, :, tap, None] * xp[:, :, tap:tap + L]
    if bias is not None:
        out += bias.double()[None, :, None]
    return _act(out, activation)


def causal_conv1d_update_ref(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                             bias: torch.Tensor | None = None, activation: str | None = None):
    """One decode step of the causal conv, without touching the inputs.

    x (B, D, L) new tokens, conv_state (B, D, S) the last S inputs (S >= W-1), weight (D, W)
    -> out (B, D, L) float64, new_state (B, D, S) float64 (the last S inputs after x).

        conv_state           x
        [s0 s1 ... sS-1] [x0 x1 ... xL-1]      out[t] reads the W inputs ending at x_t
    """
    B, D, L = x.shape
    S, W = conv_state.shape[-1], weight.shape[1]
    if S < W - 1:
        raise ValueError(f"conv_state holds {S} steps but width {W} needs at least {W - 1}.")
    full = torch.cat([conv_state.double(), x.double()], dim=-1)  # (B, D, S+L)
    w = weight.double()
    out = torch.zeros(B, D, L, dtype=torch.float64, device=x.device)
    for tap in range(W):
        start = S - (W - 1) + tap
        out += w[None, :, tap, None] * full[:, :, start:start + L]
    if bias is not None:
        out += bias.double()[None, :, None]
    return _act(out, activation), full[:, :, -S:]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (fla's and transformers' definition)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule_ref(q, k, v, g, beta, scale: float | None = None, initial_state=None,
                         use_qk_l2norm: bool = False):
    """Naive recurrent gated delta rule in float64 (definition in the module docstring).

    q, k (B, T, H, K); v (B, T, H, V); g (B, T, H) log decay (<= 0); beta (B, T, H) in (0, 1);
    initial_state (B, H, K, V) or None; scale defaults to K**-0.5.
    -> o (B, T, H, V) float64, final state (B, H, K, V) float64.
    """
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    B, T, H, K = k.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    S = torch.zeros(B, H, K, V, dtype=torch.float64, device=q.device)
    if initial_state is not None:
        S = initial_state.double().clone()
    o = torch.zeros(B, T, H, V, dtype=torch.float64, device=q.device)
    for t in range(T):
        S = S * torch.exp(g[:, t])[..., None, None]
        pred = torch.einsum("bhkv,bhk->bhv", S, k[:, t])
        u = beta[:, t, :, None] * (v[:, t] - pred)
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], u)
        o[:, t] = torch.einsum("bhkv,bhk->bhv", S, q[:, t] * scale)
    return o, S


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN when out holds NaN or inf (never <= a tolerance)."""
    out = out.double()
    if not torch.isfinite(out).all():
        return math.nan
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------------------------------
# The GPU check
# ----------------------------------------------------------------------------------------------------
def poison_allocator(numel: int, dtype: torch.dtype, device) -> None:
    """Fill a block of the caching allocator with NaN and free it: the kernel's next output of this
    size reuses it, so an output the kernel never writes reads NaN and fails instead of passing."""
    torch.full((numel,), float("nan"), dtype=dtype, device=device)


def _verdict(name: str, err: float) -> dict:
    return {"name": name, "rel_err": err, "ok": err <= RTOL}  # NaN <= x is False


def run_conv(device, dtype=torch.bfloat16, B=2, D=512, L=1000, W=4) -> list[dict]:
    """causal_conv1d_fn and causal_conv1d_update (one decode step) vs the references."""
    from causal_conv1d import causal_conv1d_fn, causal_conv1d_update

    x = torch.randn(B, D, L, device=device, dtype=dtype)
    weight = (torch.randn(D, W, device=device) / W).to(dtype)
    bias = torch.randn(D, device=device, dtype=dtype)
    poison_allocator(x.numel(), dtype, device)
    out = causal_conv1d_fn(x, weight, bias, activation="silu")
    results = [_verdict("causal_conv1d_fn", rel_error(out, causal_conv1d_ref(x, weight, bias, "silu")))]

    state = torch.randn(B, D, W - 1, device=device, dtype=dtype)
    x1 = torch.randn(B, D, 1, device=device, dtype=dtype)
    ref_out, ref_state = causal_conv1d_update_ref(x1, state, weight, bias, "silu")
    poison_allocator(x1.numel(), dtype, device)
    out1 = causal_conv1d_update(x1, state, weight, bias, activation="silu")  # updates `state` in place
    results.append(_verdict("causal_conv1d_update", max(rel_error(out1, ref_out), rel_error(state, ref_state))))
    return results


def run_gated_delta(device, dtype=torch.bfloat16, B=1, T=200, H=4, K=128, V=128) -> list[dict]:
    """fla's chunk_gated_delta_rule (as transformers calls it: q/k l2-normalised in the kernel, with an
    initial state and the final state out) vs the recurrent reference. T=200 leaves a partial chunk."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    q = torch.randn(B, T, H, K, device=device, dtype=dtype)
    k = torch.randn(B, T, H, K, device=device, dtype=dtype)
    v = torch.randn(B, T, H, V, device=device, dtype=dtype)
    g = (-F.softplus(torch.randn(B, T, H, device=device)) * 0.5).float()  # Qwen3.5 computes g in fp32
    beta = torch.sigmoid(torch.randn(B, T, H, device=device)).to(dtype)
    h0 = torch.randn(B, H, K, V, device=device, dtype=torch.float32) * 0.1
    poison_allocator(v.numel(), dtype, device)
    o, hT = chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                                   use_qk_l2norm_in_kernel=True)
    o_ref, h_ref = gated_delta_rule_ref(q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True)
    return [_verdict("chunk_gated_delta_rule", rel_error(o, o_ref)),
            _verdict("chunk_gated_delta_rule.final_state", rel_error(hT, h_ref))]


def run_numerics(gpus: list[dict], seed: int | None = None) -> tuple[list[dict], list[str]]:
    """Run every kernel on every visible GPU. Returns (results, errors): results carry device, name,
    rel_err, ok; errors name what could not run at all (an import or launch failure)."""
    if seed is not None:
        torch.manual_seed(seed)
    results, errors = [], []
    for gpu in gpus:
        device = torch.device("cuda", gpu["index"])
        with torch.cuda.device(device):
            for run in (run_conv, run_gated_delta):
                try:
                    for r in run(device):
                        results.append({"device": gpu["index"], **r})
                except Exception as e:  # a kernel that cannot even run fails the check with its error
                    errors.append(f"GPU {gpu['index']}: {run.__name__}: {type(e).__name__}: {e}")
            torch.cuda.synchronize(device)
    return results, errors
