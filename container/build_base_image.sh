#!/usr/bin/env bash
# Bootstrap the CPU base image (Debian bookworm, Python 3.11) without any registry.
#
# debootstrap builds a minimal bookworm root file system from this machine's own apt mirror
# (read from /etc/apt at run time, or $DEBIAN_MIRROR), then `docker import` turns it into an
# image. Used by build_image.sh when the base image is neither present nor pullable.
#
# Usage: container/build_base_image.sh [TAG]      (default TAG: fp16-sdk-base:bookworm)
#        FORCE=1 rebuilds an existing TAG.
set -euo pipefail

tag="${1:-fp16-sdk-base:bookworm}"
suite="bookworm"
packages="python3,python3-venv,ca-certificates"

if docker image inspect "$tag" >/dev/null 2>&1 && [[ "${FORCE:-0}" != 1 ]]; then
    echo "base image $tag already present (FORCE=1 rebuilds it)"
    exit 0
fi
if ! command -v debootstrap >/dev/null; then
    echo "debootstrap is missing: apt-get install -y debootstrap" >&2
    exit 1
fi
if [[ $EUID -ne 0 ]]; then
    echo "debootstrap needs root: run this script as root (e.g. sudo $0)" >&2
    exit 1
fi

# The machine's own mirror (read from /etc/apt at run time, or $DEBIAN_MIRROR).
mirror="$("$(dirname "${BASH_SOURCE[0]}")/apt_mirror.sh" "$suite")"

rootfs="$(mktemp -d /tmp/fp16-sdk-rootfs.XXXXXX)"
trap 'rm -rf --one-file-system "$rootfs"' EXIT

echo "debootstrap $suite ($packages) from the machine's apt mirror into $rootfs"
debootstrap --variant=minbase --include="$packages" "$suite" "$rootfs" "$mirror"

# Keep the image small: package lists, caches and documentation are not needed to run.
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin \
       "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/usr/share/doc/* \
       "$rootfs"/usr/share/man/* "$rootfs"/usr/share/locale/*

tar --numeric-owner -C "$rootfs" -c . | docker import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' \
    - "$tag"
echo "built base image $tag"
