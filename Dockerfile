# dflash-images: the wheel builder and the slim runtime image `dflash-train`.
#
# Build through the project's CLI (`make wheels`, `make image`): it reads targets.toml and passes the
# build args below, the host's CA bundle as the BuildKit secret `ca`, and --network=host. By hand:
#   DOCKER_BUILDKIT=1 docker build --network=host --secret id=ca,src=/etc/ssl/certs/ca-certificates.crt \
#     --build-arg TARGET=cu130-sm120 --build-arg TORCH_LOCK=cu130 \
#     --build-arg BUILDER_BASE=dflash-base:bookworm --target wheels --output type=local,dest=out .
# and for the runtime image, with the wheels in dist/wheels/<target>/:
#     ... --build-arg RUNTIME_BASE=dflash-base:bookworm --build-arg TORCH_ENV_FROM=runtime-os \
#     --target runtime -t dflash-train:cu130-sm120 .
# No `# syntax=` line on purpose: it makes BuildKit pull a frontend image, which offline hosts cannot.

# Base images come from targets.toml ([toolkits.*].builder_base / runtime_base); these defaults are the
# default target's (cu128-sm120): the offline Debian base for both, as for the cu130 targets.
ARG BUILDER_BASE=dflash-base:bookworm
ARG RUNTIME_BASE=dflash-base:bookworm
# Where nvcc comes from ([toolkits.*].kind): "pypi" (NVIDIA's wheels in the builder lock) or "image"
# (copied out of CUDA_IMAGE, which the CLI passes by digest from locks/images.toml after checking the
# local image against it). Only the toolkit-image stage reads CUDA_IMAGE, so a pypi target never pulls it.
ARG TOOLKIT_KIND=image
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-devel-ubuntu24.04
# Which OS stage python-torch starts from: builder-os for `--target wheels`/`toolkit`, runtime-os for
# `--target runtime` (the CLI sets it). Where both bases are one image (the cu130 targets), the
# python-torch layers of the two builds are identical and stored once.
ARG TORCH_ENV_FROM=builder-os

FROM ${BUILDER_BASE} AS builder-os
FROM ${RUNTIME_BASE} AS runtime-os
FROM ${CUDA_IMAGE} AS cuda-image

###################################################################################################
# python-torch: a venv with the target's exact torch and its CUDA libraries (locks/<lock>/common.txt:
# the pins the builder and runtime locks share), the one multi-GB layer of both images
###################################################################################################
FROM ${TORCH_ENV_FROM} AS python-torch
# Folder under locks/ with the hash-pinned common.txt / builder.txt / runtime.txt for the target's torch.
ARG TORCH_LOCK=cu128
# Keep apt quiet and non-interactive; the venv is the only Python environment packages go into. No pip
# cache: the layer cache is the cache, and a cache of multi-GB wheels would only double the disk used.
ENV DEBIAN_FRONTEND=noninteractive \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv
# Only common.txt is copied first, so a change to another lock file never re-runs this layer (COPY,
# not a bind mount: BuildKit does not expand build args in --mount sources). The lock files stay in the
# image as the record of what it holds. The CA bundle is a secret: it never enters a layer.
COPY locks/${TORCH_LOCK}/common.txt /opt/dflash/locks/common.txt
RUN --mount=type=secret,id=ca \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
 && pip install --progress-bar off --require-hashes --no-deps -r /opt/dflash/locks/common.txt

###################################################################################################
# toolkit: + the C++ compiler, and nvcc: NVIDIA's CUDA wheels (toolkit-pypi) or the devel image's
# compiler (toolkit-image)
###################################################################################################
FROM python-torch AS toolkit-common
ARG TORCH_LOCK=cu128
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends python3-dev g++ ccache \
 && rm -rf /var/lib/apt/lists/*
# The rest of the builder lock (what python-torch installed is already satisfied), hash-checked.
COPY locks/${TORCH_LOCK}/builder.txt /opt/dflash/locks/builder.txt
RUN --mount=type=secret,id=ca \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
 && pip install --progress-bar off --require-hashes -r /opt/dflash/locks/builder.txt

# CUDA_HOME is site-packages/nvidia/cu13, made usable by `wheelbuilder prepare-toolkit` (wheel-build).
FROM toolkit-common AS toolkit-pypi

# nvcc 12.8 is on no PyPI wheel and in no Debian release: copy the compiler, its headers and cudart out of
# the devel image, in its own layout (nvcc.profile looks in targets/x86_64-linux). Not its CUDA libraries
# (GBs): torch's wheels bring those. The devel image stays out of the layers; `nvcc --version` proves the
# copy runs on this base.
FROM toolkit-common AS toolkit-image
# The devel image's CUDA directory for this release ([toolkits.*].cuda, e.g. /usr/local/cuda-12.8).
ARG CUDA_IMAGE_HOME=/usr/local/cuda-12.8
COPY --from=cuda-image ${CUDA_IMAGE_HOME}/bin /usr/local/cuda/bin
COPY --from=cuda-image ${CUDA_IMAGE_HOME}/nvvm /usr/local/cuda/nvvm
COPY --from=cuda-image ${CUDA_IMAGE_HOME}/targets/x86_64-linux/include /usr/local/cuda/targets/x86_64-linux/include
COPY --from=cuda-image ${CUDA_IMAGE_HOME}/targets/x86_64-linux/lib/libcudart* /usr/local/cuda/targets/x86_64-linux/lib/
# Where wheelbuilder and torch.utils.cpp_extension look for nvcc.
ENV CUDA_HOME=/usr/local/cuda
RUN ln -s targets/x86_64-linux/include /usr/local/cuda/include \
 && ln -s targets/x86_64-linux/lib /usr/local/cuda/lib64 \
 && /usr/local/cuda/bin/nvcc --version

FROM toolkit-${TOOLKIT_KIND} AS toolkit

###################################################################################################
# wheel-build: fetch the pinned sdist, patch its arch flags, compile, repack deterministically, audit
###################################################################################################
FROM toolkit AS wheel-build
ARG TARGET=cu128-sm120
# Fixed so that the wheel's timestamps never depend on the build date. `python -m images wheels` always
# passes it: $SOURCE_DATE_EPOCH when set, else common.fsutil.DEFAULT_SOURCE_DATE_EPOCH (this value).
ARG SOURCE_DATE_EPOCH=1735689600
# Empty: sized from cores and free memory (wheelbuilder.toolkit.plan_jobs). Set to lower peak memory.
ARG MAX_JOBS=
ARG NVCC_THREADS=
# Changing this re-runs the compile without touching other layers (the reproducibility check uses it).
ARG REBUILD=0
# ccache is off by default here: the layer cache already makes an unchanged rebuild instant, and a cold
# compile is what two builds must agree on byte for byte. Pass CCACHE_DISABLE= (empty) to use the
# ccache mount below when iterating on recipes.
ARG CCACHE_DISABLE=1
ENV SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH} \
    CCACHE_DIR=/root/.cache/ccache \
    WHEELBUILDER_CACHE=/root/.cache/wheelbuilder
WORKDIR /src
COPY targets.toml pyproject.toml ./
COPY common ./common
COPY wheelbuilder ./wheelbuilder
RUN --mount=type=cache,id=dflash-ccache,target=/root/.cache/ccache \
    --mount=type=cache,id=wheelbuilder-sdist,target=/root/.cache/wheelbuilder \
    --mount=type=secret,id=ca \
    if [ -s /run/secrets/ca ]; then export SSL_CERT_FILE=/run/secrets/ca; fi; \
    if [ -n "$MAX_JOBS" ]; then export MAX_JOBS; else unset MAX_JOBS; fi; \
    if [ -n "$NVCC_THREADS" ]; then export NVCC_THREADS; else unset NVCC_THREADS; fi; \
    if [ -n "$CCACHE_DISABLE" ]; then export CCACHE_DISABLE; else unset CCACHE_DISABLE; fi; \
    echo "rebuild ${REBUILD}" >/dev/null \
 && export CUDA_HOME="$(python -m wheelbuilder prepare-toolkit)" \
 && python -m wheelbuilder build --target "$TARGET" --out /out --build-dir /build --log-dir /out/logs

###################################################################################################
# wheels: only the artifacts, for `--output type=local` (dist/wheels/<target>/)
###################################################################################################
FROM scratch AS wheels
COPY --from=wheel-build /out/ /

###################################################################################################
# runtime-env: the runtime image without the wheels: the locked torch, fla, transformers and dflash
# (what a target's runtime is checked against where its wheels cannot be built)
###################################################################################################
FROM python-torch AS runtime-env
ARG TARGET=cu128-sm120
ARG TORCH_LOCK=cu128
# The image runs offline. HF_HUB_OFFLINE=1: huggingface_hub, and `kernels` through it, read only the local
# cache (a --target Hub id resolves from it, a kernel missing there is an error, never a download).
# USE_HUB_KERNELS=0: transformers (5.25 depends on `kernels`) loads no kernel from the Hub at all
# (use_kernels=True refused, its FP8/MoE kernel loader skipped); the GatedDeltaNet kernels are the locked
# causal-conv1d wheel and fla. `dflash doctor`'s kernel-path check reports both.
ENV PYTHONUNBUFFERED=1 \
    DFLASH_TARGET=${TARGET} \
    DFLASH_STATE_DIR=/tmp/dflash \
    DFLASH_TARGETS_FILE=/opt/dflash/src/targets.toml \
    HF_HUB_OFFLINE=1 \
    USE_HUB_KERNELS=0
# gcc + libc headers + Python headers: Triton compiles a small C launcher at first use (and nothing
# else of a toolchain: no nvcc, no CUDA headers). tini reaps and forwards signals.
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends python3-dev gcc libc6-dev tini \
 && rm -rf /var/lib/apt/lists/*
# The rest of the runtime lock (fla, transformers, ...), hash-checked.
COPY locks/${TORCH_LOCK}/runtime.txt /opt/dflash/locks/runtime.txt
RUN --mount=type=secret,id=ca \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
 && pip install --progress-bar off --require-hashes -r /opt/dflash/locks/runtime.txt
# The project itself (pure Python; its dependencies are all in the lock above).
COPY pyproject.toml README.md targets.toml /opt/dflash/src/
COPY common /opt/dflash/src/common
COPY wheelbuilder /opt/dflash/src/wheelbuilder
COPY images /opt/dflash/src/images
COPY dflash /opt/dflash/src/dflash
RUN pip install --no-deps --no-build-isolation /opt/dflash/src

###################################################################################################
# runtime: slim image with the locked torch, the audited wheels, fla, transformers and dflash
###################################################################################################
FROM runtime-env AS runtime
ARG TARGET=cu128-sm120
ARG TORCH_LOCK=cu128
# Set to 0 only to build a deliberately broken image for tests of the health check.
ARG BUILD_CHECK=1
# The audited wheels: bind-mounted (never a layer), checked against their manifest's sha256 first.
RUN --mount=type=bind,source=dist/wheels,target=/wheels \
    python -m wheelbuilder verify --dir /wheels/${TARGET} \
 && pip install --no-deps /wheels/${TARGET}/*.whl \
 && mkdir -p /opt/dflash/wheels && cp /wheels/${TARGET}/manifest.json /opt/dflash/wheels/manifest.json
# Check at build time what can be checked without a GPU: versions, the extension's import (ABI) and
# its arch coverage.
RUN if [ "$BUILD_CHECK" = 1 ]; then dflash doctor --quick; fi
# The SBOM of the venv (CycloneDX 1.5 JSON): every installed distribution with its lock's hashes or the
# built wheel's sha256 (images/sbom.py). `python -m images publish` attaches it to the pushed image.
RUN python -m images.sbom --locks /opt/dflash/locks --wheels /opt/dflash/wheels/manifest.json \
      --out /opt/dflash/sbom.cdx.json
# localhost for containers that do not get Docker's /etc/hosts (an OCI archive or LXC template of
# this image): torchrun's store and NCCL bootstrap connect to it.
COPY images/rootfs/hosts /etc/hosts
RUN useradd --create-home --uid 1000 --shell /bin/bash dflash
USER dflash
# Declared this late on purpose: they change with every commit / wheel, and an ARG in scope is part of
# every later RUN's cache key, so declared at the top they would re-run the 5 GB venv layer each time.
ARG GIT_REVISION=unknown
ARG WHEEL_SHA256=unknown
WORKDIR /home/dflash
LABEL org.opencontainers.image.title="dflash-train" \
      org.opencontainers.image.revision="${GIT_REVISION}" \
      io.dflash.target="${TARGET}" \
      io.dflash.torch-lock="${TORCH_LOCK}" \
      io.dflash.wheel-sha256="${WHEEL_SHA256}" \
      io.dflash.sbom="/opt/dflash/sbom.cdx.json"
# The entrypoint runs the full doctor once in the background and keeps its verdict; the health check
# only reads that verdict and the trainer's heartbeat, so it stays cheap.
HEALTHCHECK --start-period=120s --interval=30s --timeout=20s --retries=1 CMD ["dflash", "healthcheck"]
ENTRYPOINT ["tini", "--", "dflash", "entrypoint"]
CMD []
