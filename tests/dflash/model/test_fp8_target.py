"""FP8 targets: the writer's layout, loading through transformers' fine-grained FP8 path (Target.load and
dflash-train's load_target), the weights' round trip, the tapped states, the GEMMs, and refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dflash.errors import TargetError
from dflash.model.fp8 import FP8, Fp8Linear, dequantize_weight, quantize_model, quantize_weight
from dflash.model.fp8_checkpoint import default_modules_to_not_convert, write_fp8_checkpoint
from dflash.model.target import Target
from tests.support.dflash_tiny import save_tiny_target

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    src = save_tiny_target(root / "bf16")
    record = write_fp8_checkpoint(src, root / "fp8")
    return src, root / "fp8", record


def _tensors(path: Path) -> dict:
    with safe_open(path / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_the_written_checkpoint_has_the_published_layout(dirs):
    src, fp8, record = dirs
    quant = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    assert {k: quant[k] for k in ("quant_method", "fmt", "activation_scheme", "weight_block_size")} == \
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    skip = quant["modules_to_not_convert"]
    assert {"model.embed_tokens", "lm_head", "model.norm", "model.layers.0.linear_attn.in_proj_a",
            "model.layers.0.linear_attn.in_proj_b", "model.layers.0.input_layernorm"} <= set(skip)
    t = _tensors(fp8)
    for name in ("model.layers.0.linear_attn.in_proj_qkv", "model.layers.0.linear_attn.in_proj_z",
                 "model.layers.0.linear_attn.out_proj", "model.layers.3.self_attn.q_proj", "model.layers.3.self_attn.o_proj",
                 "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.down_proj"):
        w, s = t[name + ".weight"], t[name + ".weight_scale_inv"]
        assert w.dtype == FP8 and s.dtype == torch.float32
        assert list(s.shape) == [-(-w.shape[0] // 128), -(-w.shape[1] // 128)]  # ceil-div: partial blocks
    for kept in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.linear_attn.in_proj_a.weight",
                 "model.norm.weight"):
        assert t[kept].dtype == torch.float32 and kept.replace("weight", "weight_scale_inv") not in t
    assert record["quantized"] == sum(k.endswith("weight_scale_inv") for k in t) == 50
    assert (fp8 / "tokenizer.json").is_file() and not list(fp8.parent.glob(".fp8.tmp-*"))


def test_block_quantisation_error_bound_with_partial_blocks():
    """Every element within e4m3's rounding: half a step of 3 mantissa bits (|w| / 16) above the block's
    subnormal range, and 2^-10 of the block's scale inside it; 200 x 300 has partial edge blocks."""
    torch.manual_seed(0)
    w = torch.randn(200, 300) * torch.logspace(-3, 0, 300)  # columns of very different sizes
    q, s = quantize_weight(w)
    assert q.dtype == FP8 and s.shape == (2, 3)
    back = dequantize_weight(q, s)
    per = s.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    assert ((back - w).abs() <= w.abs() / 16 + per * 2 ** -10 + 1e-12).all()
    assert (back - w).abs().max() > 0


def test_target_loads_the_fp8_checkpoint_through_transformers(dirs):
    """On a CPU transformers dequantizes at load: every FP8 linear weight equals its fp8 value x its block
    scale exactly, within e4m3 rounding of the bf16 original; same fingerprint as the bf16 target."""
    src, fp8, _ = dirs
    bf16, loaded = Target.load(src), Target.load(fp8)
    assert loaded.precision == "fp8 dequantized to float32" and bf16.precision == "float32"
    assert loaded.fingerprint == bf16.fingerprint
    stored, original = _tensors(fp8), load_file(src / "model.safetensors")
    params = dict(loaded.model.named_parameters())
    for key, w in stored.items():
        if w.dtype != FP8:
            continue
        scale = stored[key.removesuffix(".weight") + ".weight_scale_inv"]
        assert torch.equal(params[key], dequantize_weight(w, scale))
        err = (params[key] - original[key]).abs()
        assert (err <= original[key].abs() / 16 + scale.max() * 2 ** -10).all()
    assert torch.equal(params["lm_head.weight"], original["lm_head.weight"])


def test_tapped_states_of_the_fp8_target_are_near_the_bf16_ones(dirs):
    """Tolerance: relative L2 below 1 % per tapped layer for the states, below 10 % for each layer stack's own
    contribution (state minus embedding). The tiny target's residual stream is its N(0, 1) embedding, which FP8
    leaves untouched, so the states move ~1e-4; what the quantised layers add moves by a few % (e4m3 rounds
    each weight by up to 6 %). Both are measured nonzero: the FP8 weights are really in use."""
    src, fp8, _ = dirs
    bf16, loaded = Target.load(src), Target.load(fp8)
    ids = torch.randint(4, 96, (2, 48), generator=torch.Generator().manual_seed(0))
    a, b = bf16.context(ids), loaded.context(ids)
    emb = bf16.embed(ids)
    H = bf16.hidden_size
    for i, layer in enumerate(bf16.layer_ids):
        x, y = a[..., i * H:(i + 1) * H], b[..., i * H:(i + 1) * H]
        state = ((x - y).norm() / x.norm()).item()
        update = ((x - y).norm() / (x - emb).norm()).item()
        assert 0 < state < 1e-2 and 0 < update < 0.1, (layer, state, update)


def test_in_memory_quantisation_equals_the_written_checkpoint(dirs):
    """The benchmark's path (quantize_model with the writer's skip list, Fp8Linear on the dequant GEMM) gives
    the loaded FP8 checkpoint's tapped states to fp32 rounding."""
    src, fp8, _ = dirs
    mem, loaded = Target.load(src), Target.load(fp8)
    n = quantize_model(mem.model, default_modules_to_not_convert(mem.model))
    assert n == 50 and all(m.gemm == "dequant" for m in mem.model.modules() if isinstance(m, Fp8Linear))
    ids = torch.randint(4, 96, (1, 40), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(mem.context(ids), loaded.context(ids), rtol=1e-5, atol=1e-5)


def test_the_training_path_loads_an_fp8_target(dirs, tmp_path):
    from dflash.config import TrainConfig
    from dflash.train.setup import load_target

    _, fp8, _ = dirs
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "w1"},
                                             {"role": "assistant", "content": "w2"}]}) + "\n")
    cfg = TrainConfig.from_flat(target=str(fp8), data=str(data), out=str(tmp_path / "run"), device="cpu")
    target = load_target(cfg, torch.device("cpu"))
    assert target.precision.startswith("fp8") and target.num_layers == 8


def in_triton_interpreter(code: str) -> None:
    """Run `code` in a fresh Python with Triton's CPU interpreter on; it prints 'ok' when its asserts hold."""
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-3000:]


def test_triton_block_gemm_matches_the_reference_in_the_interpreter():
    """dflash.model.fp8_triton's kernel run by Triton's CPU interpreter against the dequantised product
    (fp32 accumulation both ways), on shapes with partial blocks in M, N and K."""
    code = (
        "import torch\n"
        "from dflash.model.fp8 import quantize_weight, quantize_activation, dequantize_weight\n"
        "from dflash.model.fp8_triton import block_fp8_matmul\n"
        "torch.manual_seed(0)\n"
        "for m, n, k in [(5, 200, 300), (33, 128, 256)]:\n"
        "    x = torch.randn(m, k); w = torch.randn(n, k) * 0.05\n"
        "    q, s = quantize_weight(w); xq, xs = quantize_activation(x)\n"
        "    ref = (xq.float() * xs.repeat_interleave(128, 1)[:, :k]) @ dequantize_weight(q, s).t()\n"
        "    y = block_fp8_matmul(xq, xs, q, s, torch.float32, block_m=16, block_n=32)\n"
        "    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max(), (m, n, k)\n"
        "print('ok')\n")
    in_triton_interpreter(code)


def test_triton_activation_quantisation_matches_the_reference_in_the_interpreter():
    """dflash.model.fp8_triton.quantize_activation (the GPU GEMMs' one-pass kernel) run by Triton's CPU
    interpreter against the eager reference, on partial blocks in M and K, from fp32 and bf16 activations,
    with an all-zero group (its scale floors at 1e-12): the scales equal exactly and come column-major
    (scaled_mm's layout), and the fp8 values equal the reference's unrounded values x / scale put through the
    interpreter's own fp32 -> e4m3 cast. That cast is an emulation that does not round to nearest even
    (124.3 -> 64, ties upward), so it stands in for torch's here; the GPU test below holds every value to
    torch's cast bit for bit on the hardware's."""
    code = (
        "import torch, triton, triton.language as tl\n"
        "from dflash.model.fp8 import FP8_MAX\n"
        "from dflash.model.fp8 import quantize_activation as reference\n"
        "from dflash.model.fp8_triton import quantize_activation\n"
        "@triton.jit\n"
        "def cast(x_ptr, q_ptr, N: tl.constexpr):\n"
        "    i = tl.arange(0, N)\n"
        "    tl.store(q_ptr + i, tl.load(x_ptr + i).to(q_ptr.dtype.element_ty))\n"
        "torch.manual_seed(0)\n"
        "for m, k, dtype in [(5, 300, torch.float32), (70, 256, torch.bfloat16), (33, 128, torch.float32)]:\n"
        "    x = (torch.randn(m, k) * 3).to(dtype); x[0, :128] = 0\n"
        "    xq, xs = quantize_activation(x, rows=32)\n"
        "    rq, rs = reference(x)\n"
        "    assert xs.shape == rs.shape and xs.stride() == (1, m), (xs.shape, xs.stride())\n"
        "    assert torch.equal(xs, rs), (m, k, (xs - rs).abs().max())\n"
        "    unrounded = (x.float() / rs.repeat_interleave(128, 1)[:, :k]).clamp(-FP8_MAX, FP8_MAX).flatten()\n"
        "    n = triton.next_power_of_2(unrounded.numel())\n"
        "    want = torch.empty(n, dtype=torch.float8_e4m3fn)\n"
        "    cast[(1,)](torch.nn.functional.pad(unrounded, (0, n - unrounded.numel())), want, N=n)\n"
        "    assert torch.equal(xq.flatten().view(torch.uint8), want[:m * k].view(torch.uint8)), (m, k)\n"
        "print('ok')\n")
    in_triton_interpreter(code)


@pytest.mark.parametrize("arch", [90, 120])
def test_the_triton_kernels_compile_for_the_gpus_they_serve(arch):
    """Both FP8 kernels compile to a cubin for SM 9.0 and SM 12.0 without a GPU (Triton's own compiler and
    ptxas): the interpreter above runs the kernels' Python, not their GPU compile. The quantisation divides x
    by its scale with IEEE rounding (div.rn), as torch does, not the approximate div.full of Triton's `/`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dflash.model.fp8_triton import _block_fp8_kernel, _quantize_kernel

    ints = dict.fromkeys(("M", "N", "K"), "i32")
    quant = ASTSource(fn=_quantize_kernel, constexprs={"ROWS": 32, "GROUP": 128, "FMAX": 448.0}, signature={
        "x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "M": "i32", "K": "i32",
        **{f"stride_{n}": "i32" for n in ("xm", "xk", "qm", "qk", "sm", "sk")},
        "ROWS": "constexpr", "GROUP": "constexpr", "FMAX": "constexpr"})
    gemm = ASTSource(fn=_block_fp8_kernel, constexprs={"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8,
                                                         "NUM_KB": 40}, signature={
        "a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "c_ptr": "*bf16", **ints,
        **{f"stride_{n}": "i32" for n in ("am", "ak", "asm", "ask", "wn", "wk", "wsn", "wsk", "cm", "cn")},
        **dict.fromkeys(("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "NUM_KB"), "constexpr")})
    target = GPUTarget("cuda", arch, 32)
    q = triton.compile(quant, target=target)
    assert q.asm["cubin"] and "div.rn.f32" in q.asm["ptx"]
    assert triton.compile(gemm, target=target).asm["cubin"]


@pytest.mark.gpu
def test_triton_activation_quantisation_equals_the_reference_on_the_gpu():
    """On an FP8 GPU the kernel's fp8 values and scales equal the eager reference's bit for bit, at the
    27B shape's widths (5,120 and 17,408 columns, 8,192 tokens) and on partial blocks."""
    from dflash.model.fp8 import fp8_capable
    from dflash.model.fp8 import quantize_activation as reference
    from dflash.model.fp8_triton import quantize_activation

    if not torch.cuda.is_available() or not fp8_capable("cuda"):
        pytest.skip("needs a CUDA GPU with FP8 (compute capability 8.9 or newer)")
    torch.manual_seed(0)
    for m, k in [(8192, 5120), (8192, 17408), (70, 300)]:
        x = (torch.randn(m, k, device="cuda") * 3).to(torch.bfloat16)
        xq, xs = quantize_activation(x)
        rq, rs = reference(x)
        assert torch.equal(xs, rs), (m, k)
        assert torch.equal(xq.view(torch.uint8), rq.view(torch.uint8)), (m, k)


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_an_unknown_quantization_method_is_refused_before_weights_load(dirs, tmp_path):
    _, fp8, _ = dirs
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = _config(fp8)
    cfg["quantization_config"]["quant_method"] = "gptq"
    (bad / "config.json").write_text(json.dumps(cfg))  # no weights at all: the refusal comes first
    with pytest.raises(TargetError, match=r"config.json: quantization_config.quant_method is 'gptq'.*fp8-write"):
        Target.load(bad)


SCALE = "model.layers.0.mlp.down_proj.weight_scale_inv"  # [1, 1]: its weight [32, 48] is one partial block
WEIGHT = "model.layers.0.mlp.down_proj.weight"


def _with_tensors(fp8: Path, bad: Path, change) -> Path:
    """A copy at `bad` of the FP8 directory `fp8` whose tensors {name: tensor} `change` edits in place."""
    bad.mkdir()
    for f in fp8.iterdir():
        if f.name != "model.safetensors":
            (bad / f.name).write_bytes(f.read_bytes())
    tensors = _tensors(fp8)
    change(tensors)
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    return bad


def _scale(make):
    return lambda tensors: tensors.__setitem__(SCALE, make(tensors[SCALE]))


DAMAGED_SCALES = {
    "wrong-shape": (_scale(lambda s: torch.ones(2, 2)), f"{SCALE} is [2, 2], the FP8 weight {WEIGHT} [32, 48] needs [1, 1]"),
    "one-dimensional": (_scale(lambda s: s.view(-1)), f"{SCALE} is [1], the FP8 weight {WEIGHT} [32, 48] needs [1, 1]"),
    "missing": (lambda t: t.pop(SCALE), f"the FP8 weight {WEIGHT} [32, 48] has no scale tensor {SCALE}; the checkpoint "
                                        "is incomplete"),
    "zero": (_scale(torch.zeros_like), f"{SCALE} holds 1 zero of its 1 scales, so those blocks would load as all-zero"),
    "negative": (_scale(torch.neg), f"{SCALE} holds 1 negative of its 1 scales, so those blocks would load as "
                                    "sign-flipped"),
    "nan": (_scale(lambda s: torch.full_like(s, float("nan"))), f"{SCALE} holds 1 NaN of its 1 scales"),
    "infinite": (_scale(lambda s: torch.full_like(s, float("inf"))), f"{SCALE} holds 1 infinite of its 1 scales"),
    "int32": (_scale(lambda s: s.to(torch.int32)), f"{SCALE} is I32, not a float type that holds a scale"),
    "float8": (_scale(lambda s: s.to(FP8)), f"{SCALE} is F8_E4M3, not a float type that holds a scale"),
    "scale-of-a-bf16-weight": (lambda t: t.update({"model.norm.weight_scale_inv": torch.ones(1, 1)}),
                               "model.norm.weight_scale_inv scales no float8 weight (its weight is F32 [32])"),
}


@pytest.mark.parametrize("name", DAMAGED_SCALES)
def test_a_damaged_scale_tensor_is_refused_by_name_before_weights_load(dirs, tmp_path, capfd, name):
    """Each of these loaded before without a word (NaN, infinite, zero, sign-flipped or rescaled weights) or
    failed inside transformers' loader with a traceback (a scale beside a bf16 weight); now the message names
    the tensor and its file, and the weights never load."""
    change, words = DAMAGED_SCALES[name]
    bad = _with_tensors(dirs[1], tmp_path / "bad", change)
    capfd.readouterr()
    with pytest.raises(TargetError) as refused:
        Target.load(bad)
    message = str(refused.value)
    assert message.startswith(f"{bad / 'model.safetensors'}: ") and words in message, message
    assert message.endswith("write it again from the bf16 checkpoint (dflash fp8-write BF16_DIR FP8_DIR), or download "
                            "it again")
    assert "Loading weights" not in capfd.readouterr().err


def test_a_bfloat16_scale_tensor_loads_as_its_float32_value(dirs, tmp_path):
    """bfloat16 is a float type that holds a scale: the weights load as the fp8 values x those scales."""
    bad = _with_tensors(dirs[1], tmp_path / "bf16-scale", _scale(lambda s: s.to(torch.bfloat16)))
    loaded = Target.load(bad)
    t = _tensors(bad)
    want = dequantize_weight(t[WEIGHT], t[SCALE].float())
    torch.testing.assert_close(dict(loaded.model.named_parameters())[WEIGHT], want, rtol=0, atol=0)


def test_dflash_train_on_an_fp8_target_with_a_zero_scale_exits_5_naming_it(tmp_path, capsys):
    from dflash.cli import train_main
    from tests.support.bad_input import assert_clear_failure
    from tests.support.dflash_train_fixtures import save_chat_target, train_args, write_chat_jsonl

    fp8 = tmp_path / "fp8"
    write_fp8_checkpoint(save_chat_target(tmp_path / "bf16"), fp8)
    target = _with_tensors(fp8, tmp_path / "target", _scale(torch.zeros_like))
    code = train_main(train_args(target, write_chat_jsonl(tmp_path / "chat.jsonl", n=4), tmp_path / "out"))
    err = capsys.readouterr().err
    assert_clear_failure(code, 5, err, [f"{target / 'model.safetensors'}: {SCALE} holds 1 zero", "dflash fp8-write"])
    assert "Loading weights" not in err


def test_the_writer_refuses_an_existing_output_and_a_quantised_source(dirs, tmp_path):
    src, fp8, _ = dirs
    with pytest.raises(TargetError, match="exists"):
        write_fp8_checkpoint(src, fp8)
    with pytest.raises(TargetError, match="already has a quantization_config"):
        write_fp8_checkpoint(fp8, tmp_path / "again")
