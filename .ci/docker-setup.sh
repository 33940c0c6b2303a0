#!/usr/bin/env bash
# Provide a running Docker engine and the CPU training image, for the Docker tests.
#
# Idempotent: installs docker.io and debootstrap only when missing, starts dockerd only when
# `docker info` fails, then (re)builds the image with the script `make image` runs, so the
# image always carries the current source tree (unchanged layers come from the build cache).
#
# Usage: .ci/docker-setup.sh            (as root; the lead's .ci/run calls it)
#   env: SKIP_IMAGE=1 only ensures the engine; DOCKERD_LOG (default /tmp/dockerd.log)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
log="${DOCKERD_LOG:-/tmp/dockerd.log}"
start=$SECONDS

missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if [[ ${#missing[@]} -gt 0 ]]; then
    echo "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

if ! docker info >/dev/null 2>&1; then
    echo "starting dockerd (log: $log)"
    nohup dockerd >"$log" 2>&1 &
    for _ in $(seq 1 60); do
        docker info >/dev/null 2>&1 && break
        sleep 1
    done
    if ! docker info >/dev/null 2>&1; then
        echo "dockerd did not come up within 60 s; its log:" >&2
        tail -n 30 "$log" >&2
        exit 1
    fi
fi
echo "Docker engine $(docker version --format '{{.Server.Version}}') is up"

if [[ "${SKIP_IMAGE:-0}" != 1 ]]; then
    "$repo/container/build_image.sh"
fi
echo "docker setup done in $((SECONDS - start)) s"
