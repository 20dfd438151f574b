# syntax=docker/dockerfile:1
# The GraphServing worker: `pip install .[runtime]` (torch with CUDA, the model formats, the HTTP server)
# on a CUDA runtime base. Build from the repository root:
#   docker build -f images/worker.Dockerfile -t graphserving/worker:0.1.0 .
# The operator runs it as `graphserving-worker --config ...` with the weights mounted at /models.

FROM nvidia/cuda:12.6.3-runtime-ubuntu24.04 AS build
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
COPY operator ./operator
COPY runtime ./runtime
RUN python3 -m venv /opt/graphserving \
    && /opt/graphserving/bin/pip install ".[runtime]" \
    && /opt/graphserving/bin/python -c "import torch; assert torch.version.cuda, 'torch without CUDA'"

FROM nvidia/cuda:12.6.3-runtime-ubuntu24.04
LABEL org.opencontainers.image.title="graphserving-worker" \
      org.opencontainers.image.description="GraphServing CUDA-graph LLM decode worker" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/graphserving /opt/graphserving
# HOME=/tmp: the operator mounts an emptyDir there and the root filesystem is read-only (the
# restricted Pod Security Standard); caches under ~ (Triton, CUDA, tokenizers) land in it. The
# passwd entry lets libraries that look the user up (getpass) find one.
ENV PATH=/opt/graphserving/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HOME=/tmp
RUN groupadd --gid 65532 graphserving \
    && useradd --uid 65532 --gid 65532 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin graphserving \
    && mkdir -p /models && chown 65532:65532 /models
# Numeric, so that runAsNonRoot can verify it; the operator's Pods run as the same uid/gid.
USER 65532:65532
EXPOSE 8000
ENTRYPOINT ["graphserving-worker"]
CMD ["--help"]
