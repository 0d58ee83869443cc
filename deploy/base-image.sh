#!/usr/bin/env bash
# A Debian bookworm base image built from Debian's packages alone, for machines where no image
# registry can be reached (`FROM python:3.11-slim` cannot be pulled): debootstrap builds the root
# file system (python3, venv, pip, ca-certificates; about 95 s on 2 cores) and `docker import` makes
# it an image. The Dockerfile takes it as its base:  docker build --build-arg BASE_IMAGE=NAME .
# (`make image` does all of this when the default base cannot be pulled.)
#
#   deploy/base-image.sh [NAME]     default NAME: llm-decode-engine-base:bookworm
#
# Needs root (debootstrap) and a Docker daemon. An existing image of that name is kept (FORCE=1
# rebuilds it). The mirror is debootstrap's default unless DEBOOTSTRAP_MIRROR names another.
# Extra packages: BASE_PACKAGES (comma-separated) are added to the --include list.
set -euo pipefail

NAME=${1:-llm-decode-engine-base:bookworm}
SUITE=bookworm
PACKAGES=python3,python3-venv,python3-pip,ca-certificates${BASE_PACKAGES:+,$BASE_PACKAGES}

if [ "${FORCE:-0}" != 1 ] && docker image inspect "$NAME" >/dev/null 2>&1; then
  echo "base-image: $NAME exists; kept (FORCE=1 rebuilds it)" >&2
  exit 0
fi
command -v debootstrap >/dev/null 2>&1 || {
  echo "base-image: debootstrap is not installed (Debian package debootstrap: apt-get install -y debootstrap)" >&2
  exit 1
}
[ "$(id -u)" = 0 ] || { echo "base-image: debootstrap needs root (running as uid $(id -u))" >&2; exit 1; }

ROOTFS=$(mktemp -d /var/tmp/base-image.XXXXXX)
trap 'rm -rf --one-file-system "$ROOTFS"' EXIT
started=$SECONDS
echo "base-image: debootstrap $SUITE ($PACKAGES) into $ROOTFS" >&2
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOTFS" ${DEBOOTSTRAP_MIRROR:+"$DEBOOTSTRAP_MIRROR"} \
  >"$ROOTFS.log" 2>&1 || { tail -20 "$ROOTFS.log" >&2; rm -f "$ROOTFS.log"; exit 1; }
rm -f "$ROOTFS.log"
# What an image does not need: the package caches and lists, logs, the machine id.
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/log/* \
  "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/locale/* "$ROOTFS"/tmp/*
: >"$ROOTFS/etc/machine-id"
tar --numeric-owner -C "$ROOTFS" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["/bin/bash"]' \
  --message "debootstrap --variant=minbase $SUITE ($PACKAGES)" - "$NAME" >/dev/null
echo "base-image: $NAME built in $((SECONDS - started)) s ($(docker image inspect --format '{{.Size}}' "$NAME" | awk '{printf "%.0f MB", $1/1e6}'))" >&2
