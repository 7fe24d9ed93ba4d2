"""The target MLPs' fused SiLU x up and FP8 quantisation (dflash.model.fused_mlp, fp8_triton.silu_mul_quantize):
which modules, nothing on a CPU, and on a GPU the same FP8 bytes, scales and MLP outputs as eager torch."""

from __future__ import annotations

import pytest
import torch

from dflash.model.fp8 import Fp8Linear, pick_gemm
from dflash.model.fused_mlp import fuse_mlps, fused_forward, mlp_modules
from dflash.model.target import Target
from tests.support.dflash_tiny import save_tiny_target


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_target(tmp_path_factory.mktemp("qwen3_5"), "qwen3_5")


def test_every_decoder_layer_has_one_fused_mlp_and_none_changes_on_a_cpu(tiny_path):
    target = Target.load(tiny_path)
    assert len(mlp_modules(target.model)) == len(target.config.layer_types)
    assert fuse_mlps(target.model) == 0
    assert all(getattr(m.forward, "__func__", None) is not fused_forward for m in mlp_modules(target.model))


@pytest.mark.gpu
@pytest.mark.parametrize("m,k", [(8192, 17408), (100, 300), (33, 128)])
def test_silu_mul_quantize_equals_eager_silu_product_and_quantisation_on_the_gpu(m, k):
    from dflash.model.fp8_triton import quantize_activation, silu_mul_quantize

    g = torch.Generator(device="cuda").manual_seed(m + k)
    gate = (3 * torch.randn(m, k, device="cuda", generator=g)).bfloat16()
    up = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    xq, xs = silu_mul_quantize(gate, up)
    rq, rs = quantize_activation(torch.nn.functional.silu(gate) * up)
    assert xs.stride() == rs.stride()
    assert torch.equal(xs, rs)
    assert torch.equal(xq.view(torch.uint8), rq.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [256, 20])  # 2 x 20 rows: not a multiple of 16, scaled_mm's path falls back to eager
def test_a_fused_fp8_mlp_gives_eager_outputs_on_the_gpu(tokens):
    hidden, inter = 512, 1536
    torch.manual_seed(0)

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = torch.nn.Linear(hidden, inter, bias=False)
            self.up_proj = torch.nn.Linear(hidden, inter, bias=False)
            self.down_proj = torch.nn.Linear(inter, hidden, bias=False)
            self.act_fn = torch.nn.SiLU()

        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    mlp = MLP().cuda().bfloat16()
    gemm = pick_gemm("cuda")
    for name in ("gate_proj", "up_proj", "down_proj"):
        setattr(mlp, name, Fp8Linear.from_float(getattr(mlp, name), gemm))
    x = torch.randn(2, tokens, hidden, device="cuda").bfloat16()
    with torch.no_grad():
        eager = mlp(x)
        assert fuse_mlps(mlp) == 1
        fused = mlp(x)
    assert torch.equal(fused, eager)
