# Prometheus from Debian's `prometheus` package, for machines where prom/prometheus cannot be pulled
# (deploy/compose.offline.yml runs it in docker-compose.yml's place; the drill builds it):
#   docker build -f deploy/prometheus.Dockerfile --build-arg BASE_IMAGE=llm-decode-engine-base:bookworm \
#     -t llm-decode-prometheus:local deploy
# The entrypoint is prom/prometheus's (the binary; the compose service gives the flags), and it runs as
# the package's `prometheus` user with its storage in /prometheus, as prom/prometheus does.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb \
    && mkdir -p /prometheus && chown prometheus:prometheus /prometheus
USER prometheus
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
