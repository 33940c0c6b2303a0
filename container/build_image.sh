#!/usr/bin/env bash
# Build the fp16_sdk training image without a package index inside the build.
#
# 1. Make a wheelhouse on this machine (./wheelhouse/<variant>): fp16_sdk's wheel and its
#    dependencies, for the Python version of the base image. The CPU variant adds torch
#    ($TORCH_VERSION) and numpy; the GPU variant uses the base image's own CUDA torch.
# 2. Pick the base image. CPU: $BASE_IMAGE, else python:3.11-slim-bookworm when present, else
#    the registry-free fp16-sdk-base:bookworm (bootstrapped by build_base_image.sh if missing).
#    GPU: $BASE_IMAGE, else fp16-sdk-base:cuda-host when present (build_gpu_base_image.sh
#    makes it from this machine's own CUDA PyTorch, no registry), else an official CUDA
#    PyTorch image (pulled: needs a registry).
# 3. docker build container/Dockerfile with the wheelhouse as context.
# A machine with no package index builds with dependency wheels made elsewhere:
#   there:  container/build_image.sh gpu --deps-only --python-version 3.12   (no engine needed)
#   here:   container/build_image.sh gpu --no-download    (WHEELHOUSE holds <variant>/deps)
#
# Usage: container/build_image.sh [cpu|gpu] [--tag TAG] [--deps-only --python-version X.Y]
#                                 [--no-download]           (--cpu / --gpu also accepted)
#   env: BASE_IMAGE, TORCH_VERSION (default 2.13.0), WHEELHOUSE (default <repo>/wheelhouse),
#        PYTHON (default python3)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
variant="cpu"
tag=""
deps_only=0
download=1
py_version=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --gpu|gpu) variant="gpu" ;;
        --cpu|cpu) variant="cpu" ;;
        --tag) tag="$2"; shift ;;
        --deps-only) deps_only=1 ;;
        --python-version) py_version="$2"; shift ;;
        --no-download) download=0 ;;
        -h|--help) sed -n '2,22p' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "unknown argument $1 (use cpu, gpu, --tag TAG, --deps-only, --python-version" \
                "X.Y, --no-download)" >&2; exit 2 ;;
    esac
    shift
done
tag="${tag:-fp16-sdk-training:latest-$variant}"
python="${PYTHON:-python3}"
torch_version="${TORCH_VERSION:-2.13.0}"
wheelhouse="${WHEELHOUSE:-$repo/wheelhouse}/$variant"
gpu_default_base="pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime"
gpu_host_base="fp16-sdk-base:cuda-host"
start=$SECONDS
if [[ $deps_only == 1 && -z "$py_version" ]]; then
    echo "--deps-only needs --python-version X.Y (the base image's Python)" >&2
    exit 2
fi

if [[ $deps_only == 0 ]] && ! docker info >/dev/null 2>&1; then
    echo "the Docker engine is not reachable: start it (sudo systemctl start docker, or" \
         "sudo dockerd &; .ci/docker-setup.sh does both) and check that 'docker info' works" >&2
    exit 1
fi

# ---- base image ----------------------------------------------------------------------------
base="${BASE_IMAGE:-}"
if [[ $deps_only == 1 ]]; then
    :  # no engine: the Python version was given
elif [[ -z "$base" && "$variant" == cpu ]]; then
    if docker image inspect python:3.11-slim-bookworm >/dev/null 2>&1; then
        base="python:3.11-slim-bookworm"
    else
        base="fp16-sdk-base:bookworm"
        "$repo/container/build_base_image.sh" "$base"
    fi
elif [[ -z "$base" ]] && docker image inspect "$gpu_host_base" >/dev/null 2>&1; then
    base="$gpu_host_base"
fi
if [[ $deps_only == 0 ]]; then
    base="${base:-$gpu_default_base}"
    if ! docker image inspect "$base" >/dev/null 2>&1; then
        echo "pulling base image $base (without a registry: container/build_gpu_base_image.sh" \
             "makes $gpu_host_base from this machine's CUDA PyTorch)"
        docker pull "$base"
    fi
    py_version="$(docker run --rm --network none "$base" python3 -c \
        'import sys; print("%d.%d" % sys.version_info[:2])')"
    echo "base image $base (Python $py_version)"
fi

# ---- wheelhouse ----------------------------------------------------------------------------
# Fresh each time: a stale second version of a wheel would break the install. Without
# downloads the dependency wheels made elsewhere (--deps-only) stay.
if [[ $download == 1 ]]; then
    rm -rf "$wheelhouse"
elif ! ls "$wheelhouse"/deps/*.whl >/dev/null 2>&1; then
    echo "--no-download: no dependency wheels in $wheelhouse/deps (make them on a machine" \
         "with a package index: container/build_image.sh $variant --deps-only" \
         "--python-version $py_version, then copy $wheelhouse)" >&2
    exit 1
fi
rm -f "$wheelhouse"/fp16_sdk-*.whl
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
if [[ "$variant" == gpu ]]; then  # the base's own numpy, built for its torch
    mapfile -t requirements < <(printf '%s\n' "${requirements[@]}" | grep -iv '^numpy')
fi
extra=()
if [[ "$variant" == cpu ]]; then
    extra+=("torch==$torch_version" numpy)  # a GPU base brings its own torch and numpy
fi
if [[ $download == 1 ]]; then
    "$python" -m pip download --quiet --disable-pip-version-check -d "$wheelhouse/deps" \
        --only-binary=:all: --python-version "$py_version" "${requirements[@]}" "${extra[@]}"
fi
if [[ $deps_only == 1 ]]; then
    echo "dependency wheels for Python $py_version in $wheelhouse/deps" \
         "($(du -sh "$wheelhouse/deps" | cut -f1)); build with --no-download"
    exit 0
fi

# ---- build ---------------------------------------------------------------------------------
if ! docker buildx version >/dev/null 2>&1; then
    export DOCKER_BUILDKIT=0  # no buildx plugin: the engine's classic builder
fi
docker build --force-rm -f "$repo/container/Dockerfile" \
    --build-arg BASE_IMAGE="$base" \
    --build-arg FP16_SDK_VARIANT="$variant" \
    --build-arg FP16_SDK_VERSION="$(basename "$sdk_wheel" | cut -d- -f2)" \
    --label fp16_sdk.image.base="$base" \
    -t "$tag" "$wheelhouse"
# Earlier builds of this image, now untagged, only take disk space.
docker image prune -f --filter "label=fp16_sdk.image.variant=$variant" >/dev/null
echo "built $tag from $base in $((SECONDS - start)) s"
