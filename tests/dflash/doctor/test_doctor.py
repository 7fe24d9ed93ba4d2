"""The kernel doctor: each check's pass / fail / skip logic, its failure modes, the report formats,
the float64 references, and (marked) the arch check on real nvcc-built .so files and the GPU numerics."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dflash.doctor import checks as dc
from dflash.doctor import numerics as dn
from dflash.doctor import doctor
from dflash.doctor.verdict import FAIL, PASS, SKIP, CheckResult, Report, render_table
from dflash.model.kernels import kernel_functions

REPO = Path(__file__).resolve().parents[3]
NVCC = "/usr/local/cuda/bin/nvcc"
HAS_CONV = importlib.util.find_spec("causal_conv1d") is not None


# ----------------------------------------------------------------------------------------------------
# Test doubles on disk: a broken extension module and causal-conv1d dist-infos
# ----------------------------------------------------------------------------------------------------
def fake_broken_extension(site: Path) -> None:
    """Test double: a `causal_conv1d_cuda` that fails the way an extension built against another torch
    fails (the dynamic loader cannot resolve a c10 symbol)."""
    (site / "causal_conv1d_cuda.py").write_text(
        "raise ImportError('/site/causal_conv1d_cuda.cpython-311-x86_64-linux-gnu.so: undefined symbol: "
        "_ZN3c1017RegisterOperatorsD1Ev')\n")


def fake_conv_dist(site: Path, version: str, record: dict | None) -> None:
    """Test double: an installed causal-conv1d's dist-info, as the wheelbuilder writes it."""
    info = site / f"causal_conv1d-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: causal_conv1d\nVersion: {version}\n")
    if record is not None:
        (info / "wheelbuilder.json").write_text(json.dumps(record))


# ----------------------------------------------------------------------------------------------------
# Parsing
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,sm", [("12.0", 120), ("9.0", 90), ("sm_120", 120), ("sm90", 90), ("120", 120),
                                     ("12.0+PTX", 120), ("compute_86", 86), (100, 100)])
def test_parse_sm(text, sm):
    assert dc.parse_sm(text) == sm


def test_parse_sm_names_the_form():
    with pytest.raises(ValueError, match=r"MAJOR\.MINOR"):
        dc.parse_sm("blackwell")


def test_parse_label():
    assert dc.parse_label("cu130torch2.11sm120") == {"cuda": "13.0", "torch": "2.11", "arches": [120]}
    assert dc.parse_label("cu128torch2.11sm90sm120ptx") == {"cuda": "12.8", "torch": "2.11", "arches": [90, 120]}
    assert dc.parse_label("cu130") == {}


@pytest.mark.parametrize("built,installed,ok", [
    ("2.11.0", "2.11.0+cu130", True),        # PyPI's torch reports its CUDA label, the record may not
    ("2.11.0+cu128", "2.11.0+cu128", True),
    ("2.11.0+cu128", "2.11.0+cu130", False),
    ("2.10.0", "2.11.0+cu130", False),
    ("2.11", "2.11.1", True),                 # a bare minor (from a label) is the ABI unit
    ("2.10", "2.11.0", False),
])
def test_torch_matches(built, installed, ok):
    assert dc.torch_matches(built, installed) is ok


def test_expect_arch_errors_before_any_check(capsys):
    with pytest.raises(SystemExit) as e:
        doctor.main(["--expect-arch", "blackwell"])
    assert e.value.code == 2
    assert "--expect-arch" in capsys.readouterr().err


def test_expect_arches_from_env(monkeypatch):
    monkeypatch.setenv(doctor.EXPECT_ENV, "12.0, 9.0")
    assert doctor.expect_from_env() == (90, 120)
    monkeypatch.setenv(doctor.EXPECT_ENV, "12")
    with pytest.raises(ValueError, match=doctor.EXPECT_ENV):
        doctor.expect_from_env()


# ----------------------------------------------------------------------------------------------------
# Report: verdict, exit codes, table, JSON
# ----------------------------------------------------------------------------------------------------
def test_verdict_counts_only_required_failures():
    report = Report([CheckResult("a", PASS, "fine"), CheckResult("gpu", FAIL, "none", required=False),
                     CheckResult("b", SKIP, "no GPU")])
    assert report.ok and report.exit_code == 0 and report.failed == []
    report.checks.append(CheckResult("dispatch", FAIL, "falls back"))
    assert not report.ok and report.exit_code == 1 and report.failed == ["dispatch"]


def test_status_must_be_known():
    with pytest.raises(ValueError, match="pass, fail, skip"):
        CheckResult("x", "ok", "")


def test_table_is_aligned_and_names_failures():
    report = Report([CheckResult("versions", PASS, "torch 2.11"), CheckResult("dispatch", FAIL, "slow path"),
                     CheckResult("numerics", SKIP, "no GPU")])
    lines = render_table(report).splitlines()
    assert lines[0].split() == ["CHECK", "STATUS", "REASON"]
    status_col = lines[0].index("STATUS")
    reason_col = lines[0].index("REASON")
    for line in lines[1:4]:
        assert line[status_col - 2:status_col] == "  " and line[status_col] != " "
        assert line[reason_col - 1] == " " and line[reason_col] != " "
    assert "FAIL" in lines[2] and lines[-1] == "verdict: UNHEALTHY, failed: dispatch"


def test_json_schema_and_atomic_write(tmp_path):
    report = Report([CheckResult("versions", PASS, "ok", details={"torch": "2.11.0"}),
                     CheckResult("import", FAIL, "undefined symbol")], quick=True)
    path = report.save(tmp_path / "sub" / "doctor.json")
    data = json.loads(path.read_text())
    assert set(data) == {"schema", "ok", "created", "quick", "failed", "checks"}
    assert data["schema"] == 1 and data["ok"] is False and data["quick"] is True and data["failed"] == ["import"]
    for c in data["checks"]:
        assert set(c) == {"name", "status", "required", "reason", "details", "seconds"}
    Report([CheckResult("versions", PASS, "ok")]).save(path)
    assert json.loads(path.read_text())["ok"] is True
    assert [p.name for p in path.parent.iterdir()] == ["doctor.json"]  # no temp file left behind


@pytest.fixture
def canned_checks(monkeypatch):
    """The checks replaced by a fixed verdict: these tests are about --save, not about this machine."""
    report = Report([CheckResult("versions", PASS, "ok"), CheckResult("import", FAIL, "undefined symbol")])
    monkeypatch.setattr(doctor, "run_checks", lambda opts, progress=None: report)
    return report


def test_save_writes_the_verdict_and_keeps_the_exit_code(tmp_path, canned_checks, capsys):
    path = tmp_path / "state" / "doctor.json"
    assert doctor.main(["--save", str(path)]) == 1
    assert json.loads(path.read_text())["failed"] == ["import"]
    assert "verdict: UNHEALTHY, failed: import" in capsys.readouterr().out
    assert [p.name for p in path.parent.iterdir()] == ["doctor.json"]  # the probe left nothing behind


@pytest.mark.parametrize("where,fix", [("under a file", "make {parent} a writable directory"),
                                       ("a directory", "name a file, e.g. --save {path}/doctor.json")])
def test_save_to_an_unwritable_path_stops_before_any_check(tmp_path, monkeypatch, capsys, where, fix):
    monkeypatch.setattr(doctor, "run_checks", lambda *a, **k: pytest.fail("the checks ran"))
    (tmp_path / "file").write_text("")
    path = tmp_path / "file" / "doctor.json" if where == "under a file" else tmp_path
    with pytest.raises(SystemExit) as e:
        doctor.main(["--save", str(path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert f"--save {path}: cannot write the verdict there" in err
    assert fix.format(parent=path.parent, path=path) in err


def test_save_that_fails_after_the_checks_names_the_path(tmp_path, canned_checks, monkeypatch, capsys):
    """The directory can go away while the checks run: the report still prints, then a clear error."""
    state = tmp_path / "state"

    def checks_then_break_the_directory(opts, progress=None):
        state.rmdir()
        state.write_text("")  # a file where the directory was
        return canned_checks

    monkeypatch.setattr(doctor, "run_checks", checks_then_break_the_directory)
    assert doctor.main(["--save", str(state / "doctor.json")]) == 2
    out, err = capsys.readouterr()
    assert "verdict: UNHEALTHY" in out
    assert f"--save {state / 'doctor.json'}: cannot write the verdict there" in err and str(state) in err


# ----------------------------------------------------------------------------------------------------
# 1. versions (real importlib.metadata over a temp site dir)
# ----------------------------------------------------------------------------------------------------
def test_versions_fail_names_both_torches_and_the_fix(tmp_path, monkeypatch):
    fake_conv_dist(tmp_path, "1.7.0+cu130torch2.10sm120",
                   {"target": "cu130-sm120", "torch": "2.10.0", "cuda": "13.0", "arches": ["12.0"]})
    monkeypatch.syspath_prepend(str(tmp_path))
    r = dc.check_versions()
    assert r.status == FAIL
    assert "built for torch 2.10.0" in r.reason and f"torch {torch.__version__} is installed" in r.reason
    assert "make wheels" in r.reason


def test_versions_pass_with_matching_record(tmp_path, monkeypatch):
    fake_conv_dist(tmp_path, "1.7.0+cu130torch2.11sm120",
                   {"target": "cu130-sm120", "torch": torch.__version__.split("+")[0], "cuda": torch.version.cuda or "13.0",
                    "arches": ["12.0"]})
    monkeypatch.syspath_prepend(str(tmp_path))
    r = dc.check_versions()
    missing = [k for k in ("transformers", "fla-core", "triton") if dc.dist_version(k) is None]
    assert r.status == (FAIL if missing or torch.version.cuda is None else PASS), r.reason
    assert r.details["causal_conv1d_build"]["record"]["torch"] == torch.__version__.split("+")[0]


def test_versions_fail_on_cuda_mismatch_from_label_alone(tmp_path, monkeypatch):
    fake_conv_dist(tmp_path, "1.7.0+cu118torch2.11sm120", None)  # no wheelbuilder.json: the label speaks
    monkeypatch.syspath_prepend(str(tmp_path))
    r = dc.check_versions()
    if torch.version.cuda and not torch.version.cuda.startswith("11.8"):
        assert r.status == FAIL and "CUDA 11.8" in r.reason


def test_versions_fail_without_any_build_record(tmp_path, monkeypatch):
    fake_conv_dist(tmp_path, "1.7.0", None)
    monkeypatch.syspath_prepend(str(tmp_path))
    r = dc.check_versions()
    assert r.status == FAIL and "carries no build record" in r.reason


# ----------------------------------------------------------------------------------------------------
# 2. import: the error classes and the real subprocess run with a broken extension
# ----------------------------------------------------------------------------------------------------
def test_explain_import_errors():
    abi = dc.explain_import_error("causal_conv1d_cuda", ImportError("x.so: undefined symbol: _ZN3c10Foo"))
    assert "ABI" in abi and "make wheels" in abi
    lib = dc.explain_import_error("causal_conv1d_cuda", OSError("libcudart.so.12: cannot open shared object file"))
    assert "libcudart.so.12" in lib and "missing" in lib
    gone = dc.explain_import_error("fla.ops.gated_delta_rule", ModuleNotFoundError("no fla", name="fla"))
    assert "not installed" in gone and "flash-linear-attention" in gone


@pytest.fixture(scope="module")
def broken_run(tmp_path_factory):
    """`python -m dflash.doctor --quick --json` in a fresh interpreter whose path starts with a broken
    extension (test double) and a causal-conv1d dist-info recorded for another torch (test double)."""
    site = tmp_path_factory.mktemp("site")
    fake_broken_extension(site)
    fake_conv_dist(site, "1.7.0+cu130torch2.10sm120", {"torch": "2.10.0", "cuda": "13.0", "arches": ["12.0"]})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    env.pop(doctor.EXPECT_ENV, None)
    proc = subprocess.run([sys.executable, "-m", "dflash.doctor", "--quick", "--json"], cwd=site, env=env,
                          capture_output=True, text=True, timeout=300)
    return proc, json.loads(proc.stdout)


def test_broken_extension_fails_import_with_abi_hint(broken_run):
    proc, data = broken_run
    checks = {c["name"]: c for c in data["checks"]}
    assert checks["import"]["status"] == FAIL
    assert "undefined symbol" in checks["import"]["reason"] and "ABI" in checks["import"]["reason"]
    assert checks["arch"]["status"] in (FAIL, SKIP)  # a .py is no ELF; skip only while fatbin is missing


def test_cli_json_schema_and_exit_code(broken_run):
    proc, data = broken_run
    assert proc.returncode == 1
    assert data["ok"] is False and data["quick"] is True
    assert {"versions", "import"} <= set(data["failed"])
    names = [c["name"] for c in data["checks"]]
    assert names == ["gpu", "versions", "import", "arch", "dispatch", "kernel-path", "numerics", "triton", "shm",
                     "loopback"]
    by = {c["name"]: c for c in data["checks"]}
    for costly in ("dispatch", "kernel-path"):
        assert by[costly]["status"] == SKIP and by[costly]["reason"] == "skipped by --quick"
    assert by["shm"]["status"] != SKIP and by["loopback"]["status"] != SKIP  # cheap: --quick runs them
    assert "2.10.0" in by["versions"]["reason"]
    for c in data["checks"]:
        assert c["status"] in (PASS, FAIL, SKIP) and c["reason"]


# ----------------------------------------------------------------------------------------------------
# 3. arch coverage against real .so files built by nvcc
# ----------------------------------------------------------------------------------------------------
KERNEL_CU = """
__global__ void scale(float *x, float a, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] *= a; }
extern "C" void launch(float *x, float a, int n) { scale<<<(n + 255) / 256, 256>>>(x, a, n); }
"""


@pytest.fixture(scope="module")
def sm_libs(tmp_path_factory) -> dict[int, Path]:
    pytest.importorskip("wheelbuilder.fatbin")
    d = tmp_path_factory.mktemp("so")
    (d / "k.cu").write_text(KERNEL_CU)
    out = {}
    for sm in (90, 120):
        so = d / f"k{sm}.so"
        subprocess.run([NVCC, "-shared", "-Xcompiler", "-fPIC", "-gencode", f"arch=compute_{sm},code=sm_{sm}",
                        "-o", str(so), str(d / "k.cu")], check=True, capture_output=True, timeout=300)
        out[sm] = so
    return out


H200 = {"index": 0, "name": "NVIDIA H200", "sm": 90}
RTX5090 = {"index": 1, "name": "NVIDIA GeForce RTX 5090", "sm": 120}


@pytest.mark.nvcc
def test_arch_pass_when_gpu_matches(sm_libs):
    r = dc.check_arch(str(sm_libs[90]), gpus=[H200])
    assert r.status == PASS and "sm_90" in r.reason


@pytest.mark.nvcc
def test_arch_fail_names_what_it_has_and_needs(sm_libs):
    r = dc.check_arch(str(sm_libs[120]), gpus=[H200])
    assert r.status == FAIL
    assert "GPU 0 (NVIDIA H200) is sm_90" in r.reason and "sm_120" in r.reason and "make wheels" in r.reason


@pytest.mark.nvcc
def test_arch_checks_every_gpu(sm_libs):
    r = dc.check_arch(str(sm_libs[120]), gpus=[RTX5090, H200])
    assert r.status == FAIL and "GPU 0" in r.reason and "GPU 1" not in r.reason


@pytest.mark.nvcc
def test_arch_without_gpu_lists_arches_or_compares_expected(sm_libs):
    r = dc.check_arch(str(sm_libs[120]), gpus=[], expected=[])
    assert r.status == PASS and "SASS sm_120" in r.reason and "no GPU" in r.reason
    assert dc.check_arch(str(sm_libs[120]), gpus=[], expected=[120]).status == PASS
    miss = dc.check_arch(str(sm_libs[90]), gpus=[], expected=[120])
    assert miss.status == FAIL and "expected arch 12.0" in miss.reason


def test_arch_fails_on_a_file_that_is_not_elf(tmp_path):
    pytest.importorskip("wheelbuilder.fatbin")
    bogus = tmp_path / "causal_conv1d_cuda.so"
    bogus.write_bytes(b"not an ELF file")
    r = dc.check_arch(str(bogus), gpus=[])
    assert r.status == FAIL and "cannot read the fatbin" in r.reason


# ----------------------------------------------------------------------------------------------------
# 4. dispatch, cross-checked with transformers' own fallback log
# ----------------------------------------------------------------------------------------------------
def test_dispatch_reports_what_transformers_resolved():
    r = dc.check_dispatch()
    funcs = {f["kernel"]: f for f in r.details["functions"]}
    assert {"causal_conv1d_fn", "causal_conv1d_update", "chunk_gated_delta_rule",
            "fused_recurrent_gated_delta_rule"} <= set(funcs)
    assert funcs["causal_conv1d_fn"]["fast"] is HAS_CONV
    if HAS_CONV and all(f["fast"] for f in funcs.values()):
        assert r.status == PASS
    else:
        assert r.status == FAIL
        for name, f in funcs.items():
            assert (name in r.reason) is (not f["fast"])


@pytest.mark.skipif(HAS_CONV, reason="causal-conv1d is installed: nothing falls back to compare with")
def test_dispatch_agrees_with_the_fallback_warning():
    """Calling the slow function logs transformers' own fallback message for exactly that function."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as qwen

    seen = []
    handler = logging.Handler()
    handler.emit = lambda rec: seen.append(rec.getMessage())
    log = logging.getLogger("transformers.integrations.hub_kernels")
    log.addHandler(handler)
    # transformers logs this once per process (an lru_cache on Logger.warning_once): forget earlier
    # calls made by other tests so the message is emitted again here.
    getattr(logging.Logger.warning_once, "cache_clear", lambda: None)()
    try:
        out = qwen.causal_conv1d_fn(torch.randn(1, 4, 8), torch.randn(4, 3), None, activation="silu")
    finally:
        log.removeHandler(handler)
    assert out.shape == (1, 4, 8)
    assert any("`causal_conv1d_fn` is falling back to its reference PyTorch implementation" in m for m in seen)
    slow = [fn.name for fn in kernel_functions(qwen) if not fn.fast]
    assert "causal_conv1d_fn" in slow


# ----------------------------------------------------------------------------------------------------
# 6. the C compiler Triton needs; GPU presence
# ----------------------------------------------------------------------------------------------------
def test_triton_check_fails_without_a_c_compiler(monkeypatch, tmp_path):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty PATH: no gcc, no clang
    r = doctor.check_triton(gpus=[], quick=False)
    assert r.status == FAIL and "gcc" in r.reason
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert dc.find_c_compiler() is None


def test_triton_check_skips_without_gpu_but_names_the_compiler(monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    cc = dc.find_c_compiler()
    r = doctor.check_triton(gpus=[], quick=False)
    assert (r.status, r.details.get("cc")) == ((SKIP, cc) if cc else (FAIL, None))


def test_gpu_check_requires_only_when_asked():
    assert doctor.check_gpu([], require=False).status == SKIP and not doctor.check_gpu([], False).required
    r = doctor.check_gpu([], require=True)
    assert r.status == FAIL and r.blocks and "--gpus all" in r.reason
    assert doctor.check_gpu([H200], require=True).status == PASS
    assert doctor.check_numerics([]).status == SKIP


# ----------------------------------------------------------------------------------------------------
# The float64 references themselves (CPU)
# ----------------------------------------------------------------------------------------------------
def test_conv_ref_matches_conv1d():
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 6, 11, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    want = F.silu(F.conv1d(x, w.unsqueeze(1), b, padding=3, groups=6)[..., :11])
    assert torch.allclose(dn.causal_conv1d_ref(x, w, b, "silu"), want, atol=1e-12)
    # causal: the output at t never depends on inputs after t
    x2 = x.clone()
    x2[..., 7:] = 0
    assert torch.equal(dn.causal_conv1d_ref(x2, w, b)[..., :7], dn.causal_conv1d_ref(x, w, b)[..., :7])


def test_update_ref_step_by_step_equals_full_conv():
    torch.manual_seed(1)
    B, D, L, W, S = 2, 5, 9, 4, 6  # S > W-1: a longer state than needed must still work
    x, w, b = torch.randn(B, D, L), torch.randn(D, W), torch.randn(D)
    state = torch.zeros(B, D, S)
    outs = []
    for t in range(L):
        out, state = dn.causal_conv1d_update_ref(x[..., t:t + 1], state, w, b, "silu")
        outs.append(out)
    assert torch.allclose(torch.cat(outs, -1), dn.causal_conv1d_ref(x, w, b, "silu"), atol=1e-12)
    assert torch.equal(state, x[..., -S:].double())
    with pytest.raises(ValueError, match="at least 3"):
        dn.causal_conv1d_update_ref(x[..., :1], torch.zeros(B, D, 2), w)


def test_gated_delta_ref_stores_and_recalls():
    """g = 0, beta = 1, orthonormal keys: the state becomes sum_i k_i v_i^T and querying k_i returns v_i."""
    K = V = 4
    k = torch.eye(K, dtype=torch.float64).reshape(1, K, 1, K)
    v = torch.randn(1, K, 1, V, dtype=torch.float64)
    o, S = dn.gated_delta_rule_ref(k, k, v, torch.zeros(1, K, 1), torch.ones(1, K, 1), scale=1.0)
    assert torch.allclose(o, v) and torch.allclose(S[0, 0], v[0, :, 0])


def test_gated_delta_ref_matches_transformers_torch_reference():
    """An independent implementation: transformers' recurrent torch function (unwrapped), in float32."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as qwen

    ref_fn = next(fn for fn in kernel_functions(qwen) if fn.attr == "torch_recurrent_gated_delta_rule").torch_function
    torch.manual_seed(2)
    B, T, H, K, V = 2, 13, 3, 8, 5
    q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, V)
    g, beta, h0 = -F.softplus(torch.randn(B, T, H)), torch.sigmoid(torch.randn(B, T, H)), torch.randn(B, H, K, V)
    o, s = ref_fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o64, s64 = dn.gated_delta_rule_ref(q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True)
    assert dn.rel_error(o, o64) < 1e-5 and dn.rel_error(s, s64) < 1e-5


def test_rel_error_never_passes_nan():
    ref = torch.ones(4, dtype=torch.float64)
    assert dn.rel_error(ref.clone(), ref) == 0.0
    assert math.isnan(dn.rel_error(torch.tensor([1.0, float("nan"), 1.0, 1.0]), ref))
    assert dn._verdict("x", math.nan)["ok"] is False
    assert dn._verdict("x", 2e-2)["ok"] is False and dn._verdict("x", 5e-3)["ok"] is True


# ----------------------------------------------------------------------------------------------------
# 5 and 6 for real on a GPU
# ----------------------------------------------------------------------------------------------------
def _gpus():
    return dc.visible_gpus()


@pytest.mark.gpu
def test_gpu_gated_delta_numerics():
    pytest.importorskip("fla")
    for gpu in _gpus():
        for r in dn.run_gated_delta(torch.device("cuda", gpu["index"])):
            assert r["ok"], r


@pytest.mark.gpu
def test_gpu_conv_numerics():
    pytest.importorskip("causal_conv1d")
    for gpu in _gpus():
        for r in dn.run_conv(torch.device("cuda", gpu["index"])):
            assert r["ok"], r


@pytest.mark.gpu
def test_gpu_poisoned_output_fails():
    """An output left unwritten in a poisoned block reads NaN, so it cannot pass."""
    dn.poison_allocator(4096, torch.bfloat16, "cuda")
    stale = torch.empty(4096, dtype=torch.bfloat16, device="cuda")
    assert torch.isnan(stale).all()
    assert dn._verdict("stale", dn.rel_error(stale, torch.ones(4096, dtype=torch.float64, device="cuda")))["ok"] is False


@pytest.mark.gpu
def test_gpu_numerics_and_triton_checks():
    gpus = _gpus()
    r = doctor.check_triton(gpus, quick=False)
    assert r.status == PASS, r.reason
    n = doctor.check_numerics(gpus)
    assert n.status == (PASS if HAS_CONV else FAIL), n.reason
    fla_rows = [x for x in n.details["results"] if x["name"].startswith("chunk_gated_delta_rule")]
    assert fla_rows and all(x["ok"] for x in fla_rows)
