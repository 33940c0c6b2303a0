#!/usr/bin/env bash
# Build the fp16_sdk training image without a package index inside the build.
#
# 1. Make a wheelhouse on this machine (./wheelhouse/<variant>): fp16_sdk's wheel and its
#    dependencies, for the Python version of the base image. The CPU variant adds torch
#    ($TORCH_VERSION); the GPU variant uses the base image's own CUDA torch.
# 2. Pick the base image. CPU: $BASE_IMAGE, else python:3.11-slim-bookworm when present, else
#    the registry-free fp16-sdk-base:bookworm (bootstrapped by build_base_image.sh if missing).
#    GPU: $BASE_IMAGE, else an official CUDA PyTorch image (pulled: needs a registry).
# 3. docker build container/Dockerfile with the wheelhouse as context.
#
# Usage: container/build_image.sh [cpu|gpu] [--tag TAG]     (--cpu / --gpu also accepted)
#   env: BASE_IMAGE, TORCH_VERSION (default 2.13.0), WHEELHOUSE (default <repo>/wheelhouse),
#        PYTHON (default python3)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
variant="cpu"
tag=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --gpu|gpu) variant="gpu" ;;
        --cpu|cpu) variant="cpu" ;;
        --tag) tag="$2"; shift ;;
        -h|--help) sed -n '2,14p' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "unknown argument $1 (use cpu, gpu, --tag TAG)" >&2; exit 2 ;;
    esac
    shift
done
tag="${tag:-fp16-sdk-training:latest-$variant}"
python="${PYTHON:-python3}"
torch_version="${TORCH_VERSION:-2.13.0}"
wheelhouse="${WHEELHOUSE:-$repo/wheelhouse}/$variant"
gpu_default_base="pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime"
start=$SECONDS

if ! docker info >/dev/null 2>&1; then
    echo "the Docker engine is not reachable: start it (sudo systemctl start docker, or" \
         "sudo dockerd &; .ci/docker-setup.sh does both) and check that 'docker info' works" >&2
    exit 1
fi

# ---- base image ----------------------------------------------------------------------------
base="${BASE_IMAGE:-}"
if [[ -z "$base" && "$variant" == cpu ]]; then
    if docker image inspect python:3.11-slim-bookworm >/dev/null 2>&1; then
        base="python:3.11-slim-bookworm"
    else
        base="fp16-sdk-base:bookworm"
        "$repo/container/build_base_image.sh" "$base"
    fi
fi
base="${base:-$gpu_default_base}"
if ! docker image inspect "$base" >/dev/null 2>&1; then
    echo "pulling base image $base"
    docker pull "$base"
fi
py_version="$(docker run --rm --network none "$base" python3 -c \
    'import sys; print("%d.%d" % sys.version_info[:2])')"
echo "base image $base (Python $py_version)"

# ---- wheelhouse ----------------------------------------------------------------------------
# Fresh each time: a stale second version of a wheel would break the install.
rm -rf "$wheelhouse"
mkdir -p "$wheelhouse/deps"
# A fixed timestamp makes the wheel byte-identical while the source is: the build cache then
# reuses every layer.
SOURCE_DATE_EPOCH=315532800 "$python" -m pip wheel --quiet --no-deps --no-build-isolation \
    -w "$wheelhouse" "$repo"
sdk_wheel="$(ls "$wheelhouse"/fp16_sdk-*.whl)"
# fp16_sdk's own requirements, read from the wheel; torch is handled per variant below.
mapfile -t requirements < <("$python" - "$sdk_wheel" <<'PY'
import sys, zipfile
from email.parser import Parser
with zipfile.ZipFile(sys.argv[1]) as whl:
    meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
    for req in Parser().parsestr(whl.read(meta).decode()).get_all("Requires-Dist") or []:
        name = req.split(";")[0].strip()
        if "extra ==" not in req and not name.lower().startswith("torch"):
            print(name)
PY
)
extra=(numpy)
if [[ "$variant" == cpu ]]; then
    extra+=("torch==$torch_version")
fi
"$python" -m pip download --quiet --disable-pip-version-check -d "$wheelhouse/deps" \
    --only-binary=:all: --python-version "$py_version" "${requirements[@]}" "${extra[@]}"

# ---- build ---------------------------------------------------------------------------------
if ! docker buildx version >/dev/null 2>&1; then
    export DOCKER_BUILDKIT=0  # no buildx plugin: the engine's classic builder
fi
docker build -f "$repo/container/Dockerfile" \
    --build-arg BASE_IMAGE="$base" \
    --build-arg FP16_SDK_VARIANT="$variant" \
    --build-arg FP16_SDK_VERSION="$(basename "$sdk_wheel" | cut -d- -f2)" \
    --label fp16_sdk.image.base="$base" \
    -t "$tag" "$wheelhouse"
# Earlier builds of this image, now untagged, only take disk space.
docker image prune -f --filter "label=fp16_sdk.image.variant=$variant" >/dev/null
echo "built $tag from $base in $((SECONDS - start)) s"
