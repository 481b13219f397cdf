# syntax=docker/dockerfile:1
# One image for every pod the operator and the chart create: the operator, the gateway, each
# stage, and the Mooncake master and store servers. The default build is for GPU nodes
# (CUDA torch via vLLM, Mooncake's CUDA transfer engine); `--build-arg VARIANT=cpu` builds
# the CPU image the tiny demo runs on.
#
#   docker build -t ghcr.io/omni-pipeline/omni-pipeline:0.1.0 .
#   docker build --build-arg VARIANT=cpu -t omni-pipeline:cpu .
FROM python:3.11-slim-bookworm

ARG VARIANT=cuda
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/omni/bin:$PATH \
    HOME=/home/omni \
    HF_HOME=/home/omni/.cache/huggingface

# Mooncake's transfer engine links libibverbs, libnuma and libcurl; torch.compile (a stage's
# `compile: true`) builds kernels with the C/C++ compiler, on GPUs through Triton's launcher.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libibverbs1 libnuma1 libcurl4 g++ \
 && rm -rf /var/lib/apt/lists/* \
 && python -m venv /opt/omni

WORKDIR /src
COPY pyproject.toml README.md ./
COPY omni_pipeline ./omni_pipeline
COPY services ./services
COPY operator ./operator
RUN if [ "$VARIANT" = cpu ]; then \
      /opt/omni/bin/pip install torch==2.13.0 torchvision==0.28.0 --index-url https://download.pytorch.org/whl/cpu \
      && /opt/omni/bin/pip install ".[mooncake]"; \
    else \
      /opt/omni/bin/pip install ".[vllm]" "mooncake-transfer-engine>=0.3.13"; \
    fi \
 && rm -rf /src

# The uid the chart and the rendered pods run as (runAsNonRoot).
RUN groupadd --gid 10001 omni && useradd --uid 10001 --gid 10001 --create-home omni
USER 10001:10001
WORKDIR /home/omni
CMD ["omni", "--help"]
