#!/usr/bin/env bash
# The GPU evidence of README "Performance" on a machine with an NVIDIA GPU and a Python that has torch 2.11
# (no compiler, no network needed):
#
#   bench/gpu_check.sh OUT WHEEL_DIR [WHEELHOUSE]
#   STEPS="doctor mix fp8" bench/gpu_check.sh OUT WHEEL_DIR [WHEELHOUSE]     some steps only
#
#   WHEEL_DIR   a folder written by wheelbuilder (the wheels + manifest.json), e.g. dist/wheels/cu130-sm90,
#               built on a CPU machine: python -m wheelbuilder build --target cu130-sm90 --python 3.12
#   WHEELHOUSE  wheels of the runtime lock the machine lacks (fla, transformers, pyelftools, ...), e.g. from
#               pip download --no-deps --require-hashes -r <filtered locks/cu130/runtime.txt>
#
# Always first: wheelbuilder verify (sha256 against the manifest), audit (SASS arches from the ELF) vs the GPU's
# compute capability; install the wheels into a private prefix (nothing system-wide changes). Then the STEPS
# (default: all, in this order; each under its own time limit; a failed step is reported and the next one runs):
#   doctor        dflash doctor --json -> OUT/doctor.json (must pass); again without causal-conv1d
#                 -> OUT/doctor-no-conv1d.json (must fail, naming the check)
#   tests         the GPU test tier (pytest -m gpu over the test files that have GPU tests), printed values kept
#   kernels       bench/bench_kernels.py -> OUT/kernels.json
#   train         bench/bench_train.py --presets 27b, sdpa vs flex -> OUT/train-27b.json
#   mix           bench/bench_length_mix.py --preset 27b: the fixed 2 x 4096 shape, then a chat-like mix packed
#                 and padded, each variant in a child process (MIX_VARIANTS picks them and their order; MIX_LIMIT
#                 its seconds, 480; MIX_ARGS="--fp8-target ..." an FP8 target, which fits an 80 GB card)
#                 -> OUT/length-mix-27b.json
#   mix-dflash2   the same for a DFlash2 drafter, fixed and packed (MIX2_VARIANTS) -> OUT/length-mix-27b-dflash2.json
#   fp8           bench/bench_fp8.py: an FP8 target against bf16 (SM 9.0: scaled_mm, then triton's forward) -> OUT/fp8-27b.json
#   fp8-cap       the same loops under a 102 GB cap (--layout replicate on a 96 GB card) -> OUT/fp8-27b-cap102.json
# Everything printed also goes to OUT/gpu_check.log.
set -uo pipefail

OUT=${1:?usage: bench/gpu_check.sh OUT WHEEL_DIR [WHEELHOUSE]}
WHEELS=${2:?usage: bench/gpu_check.sh OUT WHEEL_DIR [WHEELHOUSE]}
HOUSE=${3:-}
PY=${PYTHON:-python3}
REPO=$(cd "$(dirname "$0")/.." && pwd)
PREFIX=${DFLASH_GPU_PREFIX:-/tmp/dflash-gpu-check}
TRAIN_ARGS=${TRAIN_ARGS:---steps 6 --warmup 2 --reps 3}
MIX_ARGS=${MIX_ARGS:---steps 24 --warmup 6 --sequences 2000}
MIX_VARIANTS=${MIX_VARIANTS:-fixed,packed,padded}
STEPS=" ${STEPS:-doctor tests kernels train mix mix-dflash2 fp8 fp8-cap} "
wanted() { [[ "$STEPS" == *" $1 "* ]]; }
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PREFIX:$REPO"
failed=()

step() {  # step NAME SECONDS COMMAND...: run, time, record failure without stopping
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s) $(date -u +%H:%M:%S)" >&2
    local t0=$SECONDS
    timeout "$limit" "$@"
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - t0))s" >&2
    [ $rc -eq 0 ] || failed+=("$name ($rc)")
    return $rc
}

nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader
"$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))'

# 1. the wheelhouse (pyelftools & co. the audit needs), then the wheel: verify, audit against the GPU, install
rm -rf "$PREFIX" && mkdir -p "$PREFIX"
if [ -n "$HOUSE" ]; then
    step wheelhouse 120 "$PY" -m pip install --quiet --no-index --no-deps --no-compile --target "$PREFIX" "$HOUSE"/*.whl || exit 1
fi
step verify 60 "$PY" -m wheelbuilder verify --dir "$WHEELS" || exit 1
manifest_target=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["wheels"][0]["target"])' "$WHEELS/manifest.json")
pyver=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
step audit 60 "$PY" -m wheelbuilder audit --json --target "$manifest_target" --python "$pyver" "$WHEELS"/*.whl \
    > "$OUT/audit.json" || exit 1
"$PY" - "$OUT/audit.json" <<'PYEOF'
import json, sys, torch
audit = json.load(open(sys.argv[1]))
major, minor = torch.cuda.get_device_capability(0)
have = sorted({a for w in audit for a in w["arches"]["sass"]})
print(f"audit: SASS for {have}; GPU 0 is sm_{major}{minor}:", "covered" if major * 10 + minor in have else "NOT covered")
PYEOF
step install 60 "$PY" -m pip install --quiet --no-index --no-deps --no-compile --target "$PREFIX" "$WHEELS"/*.whl || exit 1

# 2-3. the doctor, then the doctor without causal-conv1d
summary() {
    "$PY" - "$1" <<'PYEOF'
import json, sys
report = json.load(open(sys.argv[1]))
for c in report["checks"]:
    print(f"  {c['status']:<5} {c['name']:<10} {c['reason']}")
PYEOF
}
if wanted doctor; then
    step doctor 120 "$PY" -m dflash.cli doctor --json --require-gpu > "$OUT/doctor.json"
    summary "$OUT/doctor.json"
    mkdir -p "$PREFIX.removed" && mv "$PREFIX"/causal_conv1d* "$PREFIX.removed"/
    echo "=== doctor without causal-conv1d (must fail)"
    timeout 120 "$PY" -m dflash.cli doctor --json --require-gpu > "$OUT/doctor-no-conv1d.json"
    rc=$?
    echo "=== doctor without causal-conv1d: exit $rc"
    [ $rc -ne 0 ] || failed+=("doctor-no-conv1d (passed although the extension is gone)")
    summary "$OUT/doctor-no-conv1d.json"
    mv "$PREFIX.removed"/* "$PREFIX"/ && rmdir "$PREFIX.removed"
fi

# the GPU tests, then the benchmarks
if wanted tests; then
    # shellcheck disable=SC2046
    step pytest-gpu "${TESTS_LIMIT:-300}" "$PY" -m pytest -q -s -m gpu -p no:cacheprovider $(grep -rl --include='test_*.py' "mark.gpu" "$REPO"/tests)
fi
wanted kernels && step kernels 100 "$PY" "$REPO/bench/bench_kernels.py" --json "$OUT/kernels.json"
# shellcheck disable=SC2086
wanted train && step train-27b 270 "$PY" "$REPO/bench/bench_train.py" --presets 27b --attention sdpa,flex $TRAIN_ARGS \
    --json "$OUT/train-27b.json"
# shellcheck disable=SC2086
wanted mix && step length-mix-27b "${MIX_LIMIT:-480}" "$PY" "$REPO/bench/bench_length_mix.py" --preset 27b --variants "$MIX_VARIANTS" \
    $MIX_ARGS --json "$OUT/length-mix-27b.json"
# shellcheck disable=SC2086
wanted mix-dflash2 && step length-mix-27b-dflash2 "${MIX_LIMIT:-360}" "$PY" "$REPO/bench/bench_length_mix.py" --preset 27b --kind dflash2 \
    --variants "${MIX2_VARIANTS:-fixed,packed}" $MIX_ARGS --json "$OUT/length-mix-27b-dflash2.json"
# shellcheck disable=SC2086
wanted fp8 && step fp8-27b 330 "$PY" "$REPO/bench/bench_fp8.py" --gemms scaled_mm,triton ${FP8_ARGS:-} --json "$OUT/fp8-27b.json"
wanted fp8-cap && step fp8-27b-cap102 330 "$PY" "$REPO/bench/bench_fp8.py" --cap-gb 102 --json "$OUT/fp8-27b-cap102.json"

echo "=== done $(date -u +%H:%M:%S); failed steps: ${failed[*]:-none}"
[ ${#failed[@]} -eq 0 ]
