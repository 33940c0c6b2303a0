#!/usr/bin/env bash
# Make the GPU base image from this machine's own CUDA PyTorch install, without any registry.
#
# For hosts that have a working CUDA PyTorch but cannot pull one (no registry, air-gapped GPU
# servers). The host's root file system becomes the image (`docker import` of a tar stream),
# less what must come from the host at run time or is not a file system:
#   - /proc /sys /dev /run /tmp /var/tmp, mount points (/mnt /media), home folders, the engine's
#     own state (/var/lib/docker, /var/lib/containerd);
#   - the NVIDIA driver's user-space parts (every file the loader's cache lists for libcuda,
#     libnvidia-*, and /usr/local/nvidia): `local_gpu` maps the running driver's own at run
#     time, as NVIDIA's toolkit does, so the image never carries a driver that may not match;
#   - anything in $EXCLUDE (space-separated absolute paths, e.g. a CUDA toolkit or profilers
#     that training does not need: the image is smaller and imports faster).
# The Python that imports torch with CUDA ($PYTHON, default python3) is put first on PATH,
# so `python3` in the image is that one, a virtual environment included.
#
# Usage: container/build_gpu_base_image.sh [TAG]     (default TAG: fp16-sdk-base:cuda-host)
#   env: PYTHON, EXCLUDE, FORCE=1 rebuilds an existing TAG.
# Then: container/build_image.sh gpu   (uses this tag when BASE_IMAGE is unset)
set -euo pipefail

tag="${1:-fp16-sdk-base:cuda-host}"
python="$(command -v "${PYTHON:-python3}")"
start=$SECONDS

if docker image inspect "$tag" >/dev/null 2>&1 && [[ "${FORCE:-0}" != 1 ]]; then
    echo "base image $tag already present (FORCE=1 rebuilds it)"
    exit 0
fi
if [[ $EUID -ne 0 ]]; then
    echo "reading the whole root file system needs root: run this script as root" >&2
    exit 1
fi
if ! info="$("$python" -c 'import sys, torch
assert torch.version.cuda, "a CPU-only torch"
print(sys.prefix, sys.version.split()[0], torch.__version__, torch.version.cuda)' 2>&1)"; then
    echo "$python does not import a CUDA build of torch ($info): set PYTHON to the" \
         "interpreter of your CUDA PyTorch install" >&2
    exit 1
fi
read -r prefix py_version torch_version cuda_version <<<"$info"
echo "host install: $python (prefix $prefix, Python $py_version), torch $torch_version," \
     "CUDA $cuda_version"

# Kept as empty folders (the runtime mounts over them) / left out whole.
emptied=(/proc /sys /dev /run /tmp /var/tmp /mnt /media /home /root)
excludes=(/lost+found /var/lib/docker /var/lib/containerd /var/cache/apt /usr/local/nvidia
          "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)")  # this source tree
# The driver's user-space libraries, as the loader's cache names them (and their targets).
while read -r lib; do
    excludes+=("$lib" "$(readlink -f "$lib")" "$(readlink -f "$(dirname "$lib")")/${lib##*/}")
done < <(ldconfig -p | awk '$NF ~ /\/lib(cuda|nvidia-)[^/]*\.so/ {print $NF}')
for tool in nvidia-smi nvidia-debugdump nvidia-persistenced nvidia-cuda-mps-control \
            nvidia-cuda-mps-server; do
    p="$(command -v "$tool" || true)"
    [[ -n "$p" ]] && excludes+=("$p")
done
# shellcheck disable=SC2206  # EXCLUDE is a list of paths by design
excludes+=(${EXCLUDE:-})
args=()
for path in "${emptied[@]}"; do
    args+=("--exclude=.${path}/*")
done
for path in "${excludes[@]}"; do
    [[ "$path" == /* ]] || { echo "EXCLUDE entries must be absolute paths: $path" >&2; exit 2; }
    args+=("--exclude=.${path}")
done

path_env="$(dirname "$python"):/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
echo "importing / (less ${#excludes[@]} excluded paths) as $tag"
# tar's status 1 means files changed while read (logs): the image is still whole.
{ tar --numeric-owner -C / -c "${args[@]}" . 2>/tmp/fp16-sdk-base-tar.log || [[ $? -eq 1 ]]; } \
  | docker import \
    --change "ENV PATH=$path_env" \
    --change 'ENV LANG=C.UTF-8' \
    --change "LABEL fp16_sdk.base.torch=$torch_version fp16_sdk.base.cuda=$cuda_version" \
    --change 'CMD ["/bin/bash"]' \
    - "$tag"
docker run --rm --network none "$tag" python3 -c \
    'import torch, sys; print("image python", sys.version.split()[0], "torch", torch.__version__)'
echo "built base image $tag in $((SECONDS - start)) s"
