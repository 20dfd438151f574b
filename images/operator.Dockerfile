# syntax=docker/dockerfile:1
# The GraphServing operator: `pip install .[operator]` (kopf, kubernetes, prometheus-client; no torch).
# Build from the repository root:  docker build -f images/operator.Dockerfile -t graphserving/operator:0.1.0 .
# The chart runs it as `graphserving-operator run ...`; `graphserving canary-prompt` (helm test) ships too.

FROM python:3.11.11-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# setuptools needs every package directory the distribution declares, torch-free as they are to install.
COPY pyproject.toml README.md ./
COPY src ./src
COPY operator ./operator
COPY runtime ./runtime
RUN python -m venv /opt/graphserving \
    && /opt/graphserving/bin/pip install ".[operator]" \
    && ! /opt/graphserving/bin/python -c "import torch" 2>/dev/null

FROM python:3.11.11-slim-bookworm
LABEL org.opencontainers.image.title="graphserving-operator" \
      org.opencontainers.image.description="The GraphServing Kubernetes operator" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/graphserving /opt/graphserving
ENV PATH=/opt/graphserving/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# Non-root, numeric so that runAsNonRoot can verify it; the root filesystem can be read-only.
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["graphserving-operator"]
CMD ["run"]
