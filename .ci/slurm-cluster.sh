#!/usr/bin/env bash
# A real Slurm cluster in containers for the Slurm tests: a controller and two compute nodes
# (Debian's slurm-wlm 22.05) on a user network, one munge key, one host folder mounted at the
# same path on all three. Every container and network it creates carries the label
# fp16_sdk.slurm=<name>, and `down` removes exactly those.
#
# Usage: .ci/slurm-cluster.sh build|up|down|status|host-conf DIR
#   build   build the node image (container/slurm/) when missing or stale: its base image
#           changed, or a file of container/slurm/ did. Installs openssh-client when missing.
#   up      build if needed, then start the cluster (or keep the running one when it is
#           current), wait until both nodes are idle, and print what the tests need as
#           KEY=VALUE lines (shell-quoted: `eval "$(.ci/slurm-cluster.sh up)"`).
#   down    remove the cluster's containers and network (the folder stays).
#   status  print the same lines and exit 0 when the cluster runs and answers; exit 1 when not.
#   host-conf DIR  no containers: write DIR/slurm.conf and DIR/gres.conf for a one-node cluster
#           on this host (controller and node: $(hostname -s), its CPUs, FP16_SDK_SLURM_GPUS
#           GPUs over FP16_SDK_SLURM_GPU_FILES, default /dev/nvidia[0-N-1]), from the same
#           template; docs/slurm.md ("A GPU node") says how to start the daemons with it.
#
# env (all optional):
#   FP16_SDK_SLURM_NAME   prefix of the container and network names (default fp16-slurm):
#                         containers <name>-ctl, <name>-node1, <name>-node2, network <name>-net
#   FP16_SDK_SLURM_DIR    host folder of the cluster (default /tmp/<name>): shared/ is mounted at
#                         the same path in every container; state/ holds the munge key and the
#                         ssh key pair (generated once)
#   FP16_SDK_SLURM_BASE   base image (default $FP16_SDK_TEST_IMAGE, else fp16-sdk-training:latest-cpu)
#   FP16_SDK_SLURM_IMAGE  node image tag (default fp16-sdk-slurm:latest for the default base,
#                         fp16-sdk-slurm:<tag> for a base fp16-sdk-training:<tag>)
#   FP16_SDK_SLURM_MIN_JOB_AGE  seconds a finished job stays visible in squeue (default 60)
#   FP16_SDK_SLURM_GPUS   GPUs each compute node declares as gres/gpu (default 2: stand-in
#                         devices with /dev/null's numbers, so GPU requests schedule on CPU hosts)
#   FP16_SDK_SLURM_GPU_FILES  device files behind them, such as /dev/nvidia[0-7]: Slurm then
#                         binds them (CUDA_VISIBLE_DEVICES); the containers need the devices
#                         (FP16_SDK_SLURM_DOCKER_ARGS='--gpus all')
#   FP16_SDK_SLURM_DOCKER_ARGS  more `docker run` words for the compute nodes (word-split)
#   FP16_SDK_SLURM_IFNAME the compute nodes' interface name (default ens5: not the eth0 that
#                         code may wrongly assume; needs NET_ADMIN, which the nodes get)
# Progress goes to stderr; only the KEY=VALUE lines go to stdout.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
context="$repo/container/slurm"
name="${FP16_SDK_SLURM_NAME:-fp16-slurm}"
dir="${FP16_SDK_SLURM_DIR:-/tmp/$name}"
shared="$dir/shared"
state="$dir/state"
base="${FP16_SDK_SLURM_BASE:-${FP16_SDK_TEST_IMAGE:-fp16-sdk-training:latest-cpu}}"
min_job_age="${FP16_SDK_SLURM_MIN_JOB_AGE:-60}"
gpus="${FP16_SDK_SLURM_GPUS:-2}"
gpu_files="${FP16_SDK_SLURM_GPU_FILES:-}"
ifname="${FP16_SDK_SLURM_IFNAME:-ens5}"
read -r -a node_docker_args <<< "${FP16_SDK_SLURM_DOCKER_ARGS:-}"
label="fp16_sdk.slurm"
net="$name-net"
ctl="$name-ctl"
nodes=(node1 node2)
ready_timeout_s=60

case "$base" in
    fp16-sdk-training:latest-cpu) default_image="fp16-sdk-slurm:latest" ;;
    fp16-sdk-training:*) default_image="fp16-sdk-slurm:${base#fp16-sdk-training:}" ;;
    *) default_image="fp16-sdk-slurm:$(printf '%s' "$base" | tr -c 'A-Za-z0-9_.-' '-')" ;;
esac
image="${FP16_SDK_SLURM_IMAGE:-$default_image}"

say() { echo "[slurm-cluster] $*" >&2; }
die() { echo "[slurm-cluster] $*" >&2; exit 1; }

# ---- the node image -------------------------------------------------------------------------

context_hash() {
    (cd "$context" && sha256sum Dockerfile entrypoint.sh slurm.conf.in) | sha256sum | cut -c1-16
}

image_label() {  # image, label -> value ("" when the image or the label is missing)
    docker image inspect -f "{{index .Config.Labels \"$2\"}}" "$1" 2>/dev/null || true
}

ensure_ssh_client() {
    command -v ssh >/dev/null && command -v ssh-keygen >/dev/null && return
    [[ $EUID -eq 0 ]] || die "ssh and ssh-keygen are missing: apt-get install openssh-client"
    say "installing openssh-client"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends openssh-client \
        >&2 || { apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -q --no-install-recommends openssh-client >&2; }
}

build() {
    docker info >/dev/null 2>&1 || die "the Docker engine is not reachable ('docker info' fails)"
    local base_id want_ctx start=$SECONDS
    base_id="$(docker image inspect -f '{{.Id}}' "$base" 2>/dev/null)" \
        || die "base image $base is missing: build it with 'make image' (or set FP16_SDK_SLURM_BASE)"
    want_ctx="$(context_hash)"
    if [[ "$(image_label "$image" fp16_sdk.slurm.base-id)" == "$base_id" &&
          "$(image_label "$image" fp16_sdk.slurm.context)" == "$want_ctx" ]]; then
        say "node image $image is current (base $base)"
        return
    fi
    local mirror old_id
    old_id="$(docker image inspect -f '{{.Id}}' "$image" 2>/dev/null || true)"
    mirror="$("$repo/container/apt_mirror.sh" bookworm)"
    docker buildx version >/dev/null 2>&1 || export DOCKER_BUILDKIT=0
    say "building node image $image from $base"
    docker build -q -f "$context/Dockerfile" \
        --build-arg BASE_IMAGE="$base" --build-arg DEBIAN_MIRROR="$mirror" \
        --label fp16_sdk.slurm.base-id="$base_id" --label fp16_sdk.slurm.context="$want_ctx" \
        -t "$image" "$context" >&2
    # The earlier build of this tag, now untagged, only takes disk space (kept while in use).
    if [[ -n "$old_id" && "$old_id" != "$(docker image inspect -f '{{.Id}}' "$image")" ]]; then
        docker rmi "$old_id" >/dev/null 2>&1 || true
    fi
    say "built $image in $((SECONDS - start)) s"
}

# ---- the cluster ----------------------------------------------------------------------------

ensure_keys() {
    mkdir -p "$shared" "$state"
    if [[ ! -s "$state/munge.key" ]]; then
        (umask 077 && head -c 1024 /dev/urandom > "$state/munge.key")
    fi
    if [[ ! -s "$state/id_ed25519" ]]; then
        rm -f "$state/id_ed25519.pub"
        ssh-keygen -q -t ed25519 -N "" -C "fp16-sdk slurm test cluster" -f "$state/id_ed25519"
    fi
}

containers() { docker ps -aq --filter "label=$label=$name"; }

running_current() {  # exit 0 when all three containers run this image and this configuration
    local c want
    want="$(docker image inspect -f '{{.Id}}' "$image" 2>/dev/null)" || return 1
    for c in "$ctl" "$name-node1" "$name-node2"; do
        [[ "$(docker inspect -f '{{.State.Running}} {{.Image}} {{index .Config.Labels "fp16_sdk.slurm.config"}}' \
            "$c" 2>/dev/null)" == "true $want $(config_id)" ]] || return 1
    done
}

config_id() {
    printf '%s' "$dir|$min_job_age|$gpus|$gpu_files|$ifname|${node_docker_args[*]}" |
        sha256sum | cut -c1-16
}

start_container() {  # container name, hostname, role, extra docker run args...
    local cname="$1" host="$2" role="$3"
    shift 3
    docker run -d --init --name "$cname" --hostname "$host" \
        --network "$net" --network-alias "$host" \
        --label "$label=$name" --label "fp16_sdk.slurm.config=$(config_id)" \
        -v "$shared:$shared" -v "$state:/etc/fp16-slurm:ro" \
        -e FP16_SDK_SLURM_MIN_JOB_AGE="$min_job_age" -e FP16_SDK_SLURM_GPUS="$gpus" \
        -e FP16_SDK_SLURM_GPU_FILES="$gpu_files" -e FP16_SDK_SLURM_IFNAME="$ifname" \
        "$@" "$image" "$role" >/dev/null
}

wait_idle() {
    local deadline=$((SECONDS + ready_timeout_s)) out=""
    while ((SECONDS < deadline)); do
        out="$(docker exec "$ctl" sinfo -h -N -o '%N %t' 2>/dev/null | sort -u || true)"
        [[ "$out" == $'node1 idle\nnode2 idle' ]] && return
        sleep 0.2
    done
    say "the nodes were not idle within $ready_timeout_s s; sinfo said: ${out:-nothing}"
    for c in "$ctl" "$name-node1" "$name-node2"; do
        say "---- docker logs $c (last 15 lines)"
        docker logs --tail 15 "$c" >&2 2>&1 || true
    done
    die "the cluster did not become ready: see the logs above; '.ci/slurm-cluster.sh down' removes it"
}

down() {
    local ids
    ids="$(containers)"
    [[ -z "$ids" ]] || docker rm -f $ids >/dev/null
    ids="$(docker network ls -q --filter "label=$label=$name")"
    [[ -z "$ids" ]] || docker network rm $ids >/dev/null
}

up() {
    ensure_ssh_client
    build
    if running_current; then
        say "cluster $name is running and current"
    else
        local start=$SECONDS
        down
        ensure_keys
        docker network create --label "$label=$name" "$net" >/dev/null
        start_container "$ctl" slurmctl controller -p 127.0.0.1::22
        for n in "${nodes[@]}"; do
            start_container "$name-$n" "$n" node --cap-add NET_ADMIN "${node_docker_args[@]}"
        done
        wait_idle
        say "cluster $name up in $((SECONDS - start)) s"
    fi
    describe
}

kv() {  # KEY VALUE ...: one KEY=VALUE line each, the value single-quoted when it needs it
    while (($# >= 2)); do
        if [[ "$2" =~ ^[A-Za-z0-9_./:,@+=-]*$ ]]; then
            printf '%s=%s\n' "$1" "$2"
        else
            printf "%s='%s'\n" "$1" "${2//\'/\'\\\'\'}"
        fi
        shift 2
    done
}

describe() {
    local port key="$state/id_ed25519"
    port="$(docker port "$ctl" 22/tcp | head -n 1)"
    port="${port##*:}"
    local ssh=(ssh -i "$key" -p "$port" -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null
               -o LogLevel=ERROR -o BatchMode=yes root@127.0.0.1)
    kv FP16_SDK_SLURM_CONTROLLER "$ctl" \
        FP16_SDK_SLURM_NODE_CONTAINERS "$name-node1,$name-node2" \
        FP16_SDK_SLURM_NODES "node1,node2" \
        FP16_SDK_SLURM_NETWORK "$net" \
        FP16_SDK_SLURM_SHARED "$shared" \
        FP16_SDK_SLURM_SSH_HOST 127.0.0.1 \
        FP16_SDK_SLURM_SSH_PORT "$port" \
        FP16_SDK_SLURM_SSH_KEY "$key" \
        FP16_SDK_SLURM_SSH_COMMAND "${ssh[*]}" \
        FP16_SDK_SLURM_IMAGE "$image"
}

status() {
    if running_current && docker exec "$ctl" sinfo -h >/dev/null 2>&1; then
        describe
        return 0
    fi
    if [[ -n "$(containers)" ]]; then
        say "cluster $name exists but is not running current containers ('up' recreates it)"
    else
        say "cluster $name is not running"
    fi
    return 1
}

lock() {  # one build/up/down of this cluster at a time (two test sessions may start together)
    mkdir -p "$dir"
    exec 9>"$dir/.lock"
    flock -w 600 9 || die "another .ci/slurm-cluster.sh held $dir/.lock for 600 s"
}

host_conf() {  # DIR: slurm.conf and gres.conf for a one-node cluster on this host
    local out="${1:?host-conf needs a folder}" host n="${FP16_SDK_SLURM_GPUS:-0}"
    host="$(hostname -s)"
    mkdir -p "$out"
    local files="${gpu_files:-/dev/nvidia[0-$((n - 1))]}" types="" gres=""
    if ((n > 0)); then
        types="GresTypes=gpu" gres="Gres=gpu:$n"
        echo "Name=gpu File=$files" > "$out/gres.conf"
    else
        : > "$out/gres.conf"
    fi
    sed -e "s/@CPUS@/$(nproc)/" -e "s/@MIN_JOB_AGE@/$min_job_age/" \
        -e "s|@GRES_TYPES@|$types|" -e "s|@GRES@|$gres|" \
        -e "s/^SlurmctldHost=.*/SlurmctldHost=$host/" -e "s/node\[1-2\]/$host/g" \
        "$context/slurm.conf.in" > "$out/slurm.conf"
    say "wrote $out/slurm.conf and $out/gres.conf: node $host, $(nproc) CPUs, $n GPU(s)"
}

case "${1:-}" in
    build) lock; ensure_ssh_client; build ;;
    host-conf) host_conf "${2:-}" ;;
    up) lock; up ;;
    down) lock; start=$SECONDS; down; say "cluster $name removed in $((SECONDS - start)) s" ;;
    status) status ;;
    *) sed -n '2,28p' "${BASH_SOURCE[0]}" >&2; exit 2 ;;
esac
