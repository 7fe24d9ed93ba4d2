# dflash-images: build CUDA-extension wheels once, ship them in a slim self-checking training image.
# Every target only calls the project's own CLIs; the logic lives in Python, where it is tested.

# a [targets.*] name from targets.toml
TARGET  ?= cu128-sm120
# interpreter for the host venv (the cu130 targets' Python)
PYTHON  ?= python3.11
VENV    ?= .venv
PY      := $(VENV)/bin/python
PYTEST_ARGS ?=
# pytest-xdist workers for `make test`: the system tiers on one, the rest beside them (tests/conftest.py)
TEST_WORKERS ?= 2
# e.g. --targets cu130-sm120-torch2.14 --results bench/results/<machine>/wheels-matrix.json
BENCH_MATRIX_ARGS ?=
HOST    ?=
CTID    ?=
PUSH_ARGS ?=
# host[:port]/namespace of an OCI registry for `make publish` (credentials: docker login or DFLASH_REGISTRY_*)
REGISTRY ?=
PUBLISH_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help venv engine base lock pin-images wheels wheels-matrix index image demo lint test test-fast bench bench-build bench-matrix bench-kernels bench-scaling bench-train bench-length-mix bench-packed-target bench-multi bench-drafter bench-flex bench-fit bench-plan bench-layouts bench-loss bench-data bench-eval bench-spec-step bench-image bench-push bench-publish push push-docker publish clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-16s %s\n", $$1, $$2}'

# pip brings in the small dev lock (uv among it); uv installs torch & co. as hard links into its cache,
# so the venvs the tests create from the same lock cost almost no disk. --compile-bytecode writes the
# .pyc files once (about 40 s on 2 cores): uv writes none by default, and under PYTHONDONTWRITEBYTECODE
# no process does, so each one compiled torch, transformers and datasets from source again (3.6 s of CPU
# for every process that imports them; the suite starts hundreds of them).
$(VENV)/.installed: locks/cu130/runtime.txt locks/dev.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --require-hashes -r locks/dev.txt
	$(VENV)/bin/uv pip install --python $(PY) --link-mode hardlink --compile-bytecode --require-hashes -r locks/cu130/runtime.txt -r locks/dev.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $@

venv: $(VENV)/.installed  ## host virtualenv from the hash-pinned locks (torch 2.11.0, transformers, fla, test tools)

engine: venv  ## make sure a Docker engine with BuildKit runs (installs Debian's docker.io when root and missing)
	$(PY) -m images engine

base: engine  ## bootstrap the offline Debian base image dflash-base:bookworm (debootstrap + docker import)
	$(PY) -m images base

lock: venv  ## regenerate the PyPI locks and locks/dev.txt; TARGET=… given: that target's lock, whatever its index
	$(PY) -m wheelbuilder lock $(if $(filter command line,$(origin TARGET)),--target $(TARGET))

pin-images: engine  ## pull the CUDA devel images the builders copy nvcc from; record their digests in locks/images.toml
	$(PY) -m images pin-images

wheels: engine  ## build the target's wheels in the builder stage -> dist/wheels/$(TARGET)/
	$(PY) -m images wheels --target $(TARGET)

wheels-matrix: engine  ## every target's wheels that build here (builder stage, one after another), then dist/index
	$(PY) -m images wheels-matrix

index: venv  ## a PEP 503 simple index of dist/wheels/ in dist/index/ (per target: <server>/<target>/simple)
	$(PY) -m wheelbuilder index

image: wheels  ## build the runtime image dflash-train:$(TARGET) from dist/wheels/$(TARGET)/
	$(PY) -m images image --target $(TARGET)

demo: image  ## build what is missing, then run the built-in demo inside dflash-train:$(TARGET)
	$(PY) -m images demo --target $(TARGET)

bench-build: venv  ## compile time: target's arch vs upstream's arch list, and a warm rebuild (native nvcc)
	$(PY) bench/bench_build.py --target $(TARGET)

bench-matrix: venv  ## every PyPI-toolkit target's wheel built natively, cold: build time, sha256, ABI check in its own venv
	$(PY) bench/bench_matrix.py $(BENCH_MATRIX_ARGS)

bench-train: venv  ## drafter training throughput and time split (demo target + a larger one)
	$(PY) bench/bench_train.py

bench-length-mix: venv  ## a mix of sequence lengths: padded batches vs packed rows, useful tokens/s, recompiles, step times, memory (27B shape on a GPU)
	$(PY) bench/bench_length_mix.py

bench-packed-target: venv  ## the target's forward over a packed row vs the fixed shape: full attention masked vs flash varlen (27B shape, a GPU)
	$(PY) bench/bench_packed_target.py

bench-multi: venv  ## several drafters on one target pass: drafter-steps/s for K = 1, 2, 3 vs K separate runs, drafter forward profile (27B shape on a GPU)
	$(PY) bench/bench_multi.py

bench-drafter: venv  ## the drafter micro-batch alone at the 27B shape: before/after variants side by side, TFLOP/s, memory, gradients vs fp32 (GPU)
	$(PY) bench/bench_drafter.py --numerics

bench-flex: venv  ## flex_attention backward tile configurations at the drafter's 27B attention shape (GPU)
	$(PY) bench/bench_flex.py

bench-fit: venv  ## largest anchors x sequence length whose training micro-batch fits beside a 27B-shape target (GPU)
	$(PY) bench/bench_fit.py

bench-plan: venv  ## the memory model of `dflash plan` fitted on some shapes, predicted and measured on others (GPU)
	$(PY) bench/bench_plan.py

bench-layouts: venv  ## --layout shard vs replicate at world size 1, and offload vs replicate under a 102 GB cap (GPU)
	$(PY) bench/bench_layouts.py

bench-scaling: venv  ## multi-GPU: the training loop under torchrun on 1 and N processes (efficiency, same-loss check)
	$(PY) bench/bench_scaling.py

bench-kernels: venv  ## GatedDeltaNet kernels vs their torch fallbacks; a Qwen3.5-27B layer stack fast vs fla-only vs fallbacks
	$(PY) bench/bench_kernels.py

bench-loss: venv  ## the full-logits loss vs the chunked and the fused LM head: step time and peak GPU memory
	$(PY) bench/bench_loss.py

# the drafter bench-eval times (default: where the built-in demo, `dflash-train`, writes it)
DRAFTER ?= runs/dflash/drafter
bench-data: venv  ## data: conversations/s tokenised on 1 and N processes (100k), second start's time to first step; regeneration requests/s
	$(PY) bench/bench_data.py
	$(PY) bench/bench_regenerate.py

bench-eval: venv  ## speculative vs greedy decoding, target cache on and off (demo target, DRAFTER=dir)
	$(PY) bench/bench_eval.py --drafter $(DRAFTER)

# the target + drafter shape bench-spec-step times: 27b (one GPU, ~60 GB bf16) or tiny (CPU)
PRESET ?= 27b
bench-spec-step: venv  ## one verify, draft and greedy step's time after a 4096-token prefill; speed-up bound for tau 3,5,7
	$(PY) bench/bench_spec_step.py --preset $(PRESET)

bench-image: engine  ## runtime vs builder image size, doctor wall time, container start -> healthy
	$(PY) bench/bench_image.py --target $(TARGET)

bench-push: engine  ## export time, template size and SSH transfer throughput over loopback
	$(PY) bench/bench_push.py

bench-publish: engine  ## registry publish (first vs unchanged re-push) and push-docker vs docker save | ssh docker load
	$(PY) bench/bench_publish.py --target $(TARGET)

bench: venv  ## every bench-* benchmark this machine can run, in turn; each one it cannot run is named with what it needs
	$(PY) bench/run_all.py --preset $(PRESET) --drafter $(DRAFTER)

push: venv  ## ship the image to a Proxmox host: make push HOST=root@pve CTID=200 [PUSH_ARGS="--dry-run | --from-registry REF"]
	@test -n "$(HOST)" -a -n "$(CTID)" || { echo 'usage: make push HOST=root@pve CTID=200 [TARGET=...] [PUSH_ARGS=--dry-run]'; exit 2; }
	$(PY) -m images push --target $(TARGET) --host $(HOST) --ctid $(CTID) $(PUSH_ARGS)

publish: venv  ## push dflash-train:$(TARGET) and its SBOM to a registry: make publish REGISTRY=ghcr.io/myorg [PUBLISH_ARGS=--ca-cert ca.pem]
	@test -n "$(REGISTRY)" || { echo 'usage: make publish REGISTRY=host[:port]/namespace [TARGET=...] [PUBLISH_ARGS=--ca-cert FILE]'; exit 2; }
	$(PY) -m images publish --target $(TARGET) --registry $(REGISTRY) $(PUBLISH_ARGS)

push-docker: venv  ## stream the image to a Docker host over SSH and run its doctor: make push-docker HOST=user@gpu-box
	@test -n "$(HOST)" || { echo 'usage: make push-docker HOST=user@gpu-box [TARGET=...] [PUSH_ARGS=--port 2222]'; exit 2; }
	$(PY) -m images push-docker --target $(TARGET) --host $(HOST) $(PUSH_ARGS)

lint: venv  ## ruff over the whole tree (rules in pyproject.toml)
	$(VENV)/bin/ruff check .

# The project's own modules compiled once too (every rank and CLI process the tests start imports them).
test: venv lint engine  ## lint, then every test tier this machine can run (TEST_WORKERS=2 pytest-xdist workers)
	$(PY) -m compileall -q -j 0 common dflash images loopback wheelbuilder bench tests >/dev/null
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder $(PYTEST_ARGS)

test-fast: venv  ## unit tests only (no Docker, no compiles)
	$(PY) -m pytest -m "not docker and not nvcc and not lxc and not ssh and not gpu and not slow and not serving" $(PYTEST_ARGS)

clean:  ## remove build outputs (keeps the venv)
	rm -rf dist build logs
