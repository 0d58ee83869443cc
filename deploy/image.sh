#!/usr/bin/env bash
# `make image`: the engine's image (llm-decode-engine:local), built whichever way this machine allows.
#   - a base image can be pulled (python:3.11-slim): the Dockerfile's public defaults;
#   - none can (no image registry): a Debian bookworm base from Debian's packages (deploy/base-image.sh),
#     every wheel from a wheelhouse filled on this host (deploy/wheelhouse.sh, installed with --no-index),
#     and Prometheus from Debian's package (deploy/prometheus.Dockerfile) for deploy/compose.offline.yml.
# Either way, a CA bundle (CA_BUNDLE, else pip's PIP_CERT) is trusted by the build stage only; the final
# image is checked for it (no file with its content) and its size is reported.
#
#   deploy/image.sh                 MODE=auto|public|offline (default auto)  IMAGE=llm-decode-engine:local
#
# A rebuild with unchanged inputs reuses Docker's layer cache (seconds, plus sending the build context).
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${IMAGE:-llm-decode-engine:local}
PUBLIC_BASE=python:3.11-slim
OFFLINE_BASE=${OFFLINE_BASE:-llm-decode-engine-base:bookworm}
PROMETHEUS_IMAGE=${PROMETHEUS_IMAGE:-llm-decode-prometheus:local}
MODE=${MODE:-auto}
CA=${CA_BUNDLE:-${PIP_CERT:-}}

have_or_pull() {  # an image is here, or can be pulled now
  docker image inspect "$1" >/dev/null 2>&1 || docker pull --quiet "$1" >/dev/null 2>&1
}

if [ "$MODE" = auto ]; then
  if have_or_pull "$PUBLIC_BASE"; then MODE=public; else MODE=offline; fi
  echo "image: $PUBLIC_BASE $([ "$MODE" = public ] && echo "is at hand" || echo "cannot be pulled"): $MODE build" >&2
fi
case "$MODE" in public|offline) ;; *) echo "image: MODE=$MODE: expected auto, public or offline" >&2; exit 2 ;; esac

args=()
if [ -n "$CA" ]; then
  [ -f "$CA" ] || { echo "image: CA bundle $CA is not a file" >&2; exit 1; }
  mkdir -p deploy/build-ca  # inside the build context (git-ignored); the final image never has it
  cp "$CA" deploy/build-ca/ca.crt
  args+=(--build-arg CA_BUNDLE=deploy/build-ca/ca.crt)
fi
if [ "$MODE" = offline ]; then
  deploy/base-image.sh "$OFFLINE_BASE"
  stamp=deploy/wheelhouse/.pyproject.sha256
  if ! sha256sum --status -c "$stamp" 2>/dev/null; then
    deploy/wheelhouse.sh deploy/wheelhouse
    sha256sum pyproject.toml >"$stamp"
  fi
  args+=(--build-arg BASE_IMAGE="$OFFLINE_BASE" --build-arg WHEELHOUSE=deploy/wheelhouse)
fi

started=$SECONDS
echo "image: docker build -t $IMAGE ${args[*]:-} ." >&2
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! docker build -t "$IMAGE" "${args[@]}" . >"$log" 2>&1; then
  tail -30 "$log" >&2
  echo "image: docker build of $IMAGE failed (above: the last lines of its log)" >&2
  exit 1
fi
echo "image: $IMAGE built in $((SECONDS - started)) s" >&2

if [ -n "$CA" ]; then  # the bundle must not be in the final image: no file there has its content
  size=$(stat -c %s "$CA") sum=$(sha256sum "$CA" | cut -d' ' -f1)
  found=$(docker run --rm --user 0 --entrypoint python3 "$IMAGE" -c '
import hashlib, os, sys
size, digest = int(sys.argv[1]), sys.argv[2]
for top, dirs, files in os.walk("/"):
    dirs[:] = [d for d in dirs if os.path.join(top, d) not in ("/proc", "/sys", "/dev")]
    for name in files:
        path = os.path.join(top, name)
        if not os.path.islink(path) and os.path.isfile(path) and os.path.getsize(path) == size:
            with open(path, "rb") as f:
                if hashlib.sha256(f.read()).hexdigest() == digest:
                    print(path)
print("/build" if os.path.exists("/build") else "", end="")
' "$size" "$sum")
  if [ -n "$found" ]; then
    echo "image: the CA bundle $CA (or the build stage's /build) is in $IMAGE: $found" >&2
    exit 1
  fi
  echo "image: checked: no file in $IMAGE holds the CA bundle $CA, no /build" >&2
fi

if [ "$MODE" = offline ] && ! have_or_pull prom/prometheus:v2.55.1; then
  docker build --build-arg BASE_IMAGE="$OFFLINE_BASE" -t "$PROMETHEUS_IMAGE" - <deploy/prometheus.Dockerfile >"$log" 2>&1 \
    || { tail -30 "$log" >&2; echo "image: docker build of $PROMETHEUS_IMAGE failed" >&2; exit 1; }
  echo "image: $PROMETHEUS_IMAGE (Debian's prometheus, for deploy/compose.offline.yml) built" >&2
fi
echo "image: $IMAGE is $(docker image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.2f GB", $1/1e9}')," \
     "runs as $(docker image inspect --format '{{.Config.User}}' "$IMAGE")" >&2
