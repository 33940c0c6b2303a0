#!/usr/bin/env bash
# Pack a Docker engine to carry to a machine that has none and no package index (the GPU
# machine of benchmarks/gpu_docker.sh): Debian's docker.io, containerd, runc and tini
# (docker-init) packages, fetched with this machine's apt configuration, and the one library
# dockerd links that Ubuntu lacks (libdevmapper). Result: bin/ and lib/ in an xz tarball,
# unpacked there into /usr/local (~37 MB).
#
# Usage: container/docker_bundle.sh [OUT]     (default OUT: .dockerbin/docker.tar.xz)
set -euo pipefail
out="$(realpath -m "${1:-.dockerbin/docker.tar.xz}")"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
apt-get download docker.io containerd runc tini libdevmapper1.02.1 >/dev/null
for deb in *.deb; do dpkg -x "$deb" x; done
mkdir -p b/bin b/lib
cp -L x/usr/sbin/dockerd x/usr/bin/containerd x/usr/bin/containerd-shim-runc-v2 \
      x/usr/sbin/runc x/usr/bin/docker b/bin/
cp -L x/usr/bin/tini-static b/bin/docker-init
cp -L x/lib/x86_64-linux-gnu/libdevmapper.so.1.02.1 b/lib/
mkdir -p "$(dirname "$out")"
XZ_OPT=-9e tar -C b -cJf "$out" .
echo "$out: $(du -h "$out" | cut -f1) ($(ls b/bin | tr '\n' ' '))"
