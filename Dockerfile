# lmforge for GPU clusters: PyTorch's CUDA 13.0 image (the cu130 build the README installs) with
# lmforge and its data, quantization, evaluation and serving extras at the versions CI tests
# (constraints.txt). Build from the repository root:
#   docker build -t lmforge:latest .
# Slurm + Pyxis: set `launcher.container_image` (e.g. "lmforge:latest", or an enroot squashfs made
# with `enroot import dockerd://lmforge:latest`) and `launcher.container_mounts` (the shared file
# system holding runs/, the data and the model cache). Kubernetes: `[launcher.k8s] image`.
# Secrets (HF_TOKEN, WANDB_API_KEY, LMFORGE_API_KEY) are never baked in: jobs get them from
# their environment.
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime
FROM ${BASE_IMAGE}

# HF_HOME on the shared file system that examples/llama3_70b mounts (/fsx:/fsx): every node reads
# one copy of the hub's models and data sets (and lmforge's hub-id cache) instead of its own.
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/fsx/huggingface

WORKDIR /opt/lmforge
COPY . .
# torch comes from the base image (constraints.txt leaves it out, so pip keeps it).
# DL3013 (pin versions) does not fit: constraints.txt pins every package this installs.
# hadolint ignore=DL3013
RUN python -m pip install --no-cache-dir -c constraints.txt ".[data,quant,eval,serve]" \
    && python -c "import lmforge, torch; print('lmforge', lmforge.__version__, 'torch', torch.__version__)"

WORKDIR /workspace
CMD ["lmforge", "--help"]
