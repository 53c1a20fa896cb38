# lmforge for GPU clusters: a PyTorch CUDA image with lmforge and its data, quantization and
# evaluation extras. Build from the repository root:
#   docker build -t lmforge:latest .
# Slurm + Pyxis: set `launcher.container_image` (e.g. "lmforge:latest", or an enroot
# squashfs made with `enroot import dockerd://lmforge:latest`) and `launcher.container_mounts`
# (the shared file system holding runs/ and the data). Kubernetes: the k8s launcher's image.
# Secrets (HF_TOKEN, WANDB_API_KEY, LMFORGE_API_KEY) are never baked in: jobs get them from
# their environment.
ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/cache/huggingface

WORKDIR /opt/lmforge
COPY . .
# torch comes from the base image: it already satisfies lmforge's `torch>=2.11`, so pip keeps it.
# DL3013 (pin versions) does not fit: this installs the checked-out repository itself.
# hadolint ignore=DL3013
RUN python -m pip install --no-cache-dir ".[data,quant,eval]" \
    && python -c "import lmforge, torch; print('lmforge', lmforge.__version__, 'torch', torch.__version__)"

WORKDIR /workspace
CMD ["lmforge", "--help"]
