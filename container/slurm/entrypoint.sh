#!/bin/bash
# Entrypoint of the test cluster's node image: munged, then the role's Slurm daemon in the
# foreground (PID 1 is docker's init, started with `docker run --init`, which reaps orphans).
#
# Usage: fp16-slurm-node controller|node
#   controller: sshd (root, key login) and slurmctld; node: slurmd (NodeName = the hostname).
# Reads /etc/fp16-slurm/ (the cluster's state folder, mounted read-only): munge.key and, for
# the controller, id_ed25519.pub (authorised for root).
# env: FP16_SDK_SLURM_MIN_JOB_AGE; FP16_SDK_SLURM_GPUS (GPUs per node: Gres=gpu:N and a
# gres.conf over FP16_SDK_SLURM_GPU_FILES, the device files such as /dev/nvidia[0-7]; without
# it, stand-in devices /dev/fake-gpuN); FP16_SDK_SLURM_IFNAME (node: the name eth0 is
# renamed to before slurmd starts, so the cluster's interface is not the conventional eth0).
set -euo pipefail

role="${1:-node}"
state=/etc/fp16-slurm
min_job_age="${FP16_SDK_SLURM_MIN_JOB_AGE:-60}"

if [[ ! "$min_job_age" =~ ^[0-9]+$ ]]; then
    echo "FP16_SDK_SLURM_MIN_JOB_AGE=$min_job_age is not a whole number of seconds" >&2
    exit 2
fi
if [[ ! -r "$state/munge.key" ]]; then
    echo "$state/munge.key is missing: start the cluster with .ci/slurm-cluster.sh up" >&2
    exit 2
fi

gpus="${FP16_SDK_SLURM_GPUS:-0}"
gpu_files="${FP16_SDK_SLURM_GPU_FILES:-}"
if [[ ! "$gpus" =~ ^[0-9]+$ ]]; then
    echo "FP16_SDK_SLURM_GPUS=$gpus is not a whole number of GPUs per node" >&2
    exit 2
fi
gres_types="" gres=""
if ((gpus > 0)); then
    gres_types="GresTypes=gpu" gres="Gres=gpu:$gpus"
    if [[ -z "$gpu_files" ]]; then
        # Stand-ins for GPUs (slurmd counts gres/gpu by its device files): /dev/null's device
        # numbers, so Slurm schedules and binds them (CUDA_VISIBLE_DEVICES) on a CPU host.
        for ((i = 0; i < gpus; i++)); do
            [[ -e "/dev/fake-gpu$i" ]] || mknod -m 0666 "/dev/fake-gpu$i" c 1 3
        done
        gpu_files="/dev/fake-gpu[0-$((gpus - 1))]"
    fi
    echo "Name=gpu File=$gpu_files" > /etc/slurm/gres.conf
fi
sed -e "s/@CPUS@/$(nproc)/" -e "s/@MIN_JOB_AGE@/$min_job_age/" \
    -e "s|@GRES_TYPES@|$gres_types|" -e "s|@GRES@|$gres|" \
    /etc/slurm/slurm.conf.in > /etc/slurm/slurm.conf

rename_interface() {  # eth0 -> $1 with the kernel's own ioctls (the image has no iproute2)
    python3 - "$1" <<'PY'
import fcntl, socket, struct, sys
SIOCGIFFLAGS, SIOCSIFFLAGS, SIOCSIFNAME, IFF_UP = 0x8913, 0x8914, 0x8923, 0x1
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
old, new = b"eth0", sys.argv[1].encode()
flags = struct.unpack("16sH", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sH", old, 0)))[1]
fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH", old, flags & ~IFF_UP))
fcntl.ioctl(s, SIOCSIFNAME, struct.pack("16s16s", old, new))
fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH", new, flags | IFF_UP))
PY
}

install -o munge -g munge -m 0400 "$state/munge.key" /etc/munge/munge.key
runuser -u munge -- /usr/sbin/munged   # forks into the background once its socket is ready

case "$role" in
    controller)
        install -d -m 0700 /root/.ssh
        install -m 0600 "$state/id_ed25519.pub" /root/.ssh/authorized_keys
        ssh-keygen -A >/dev/null
        /usr/sbin/sshd
        exec /usr/sbin/slurmctld -D -i
        ;;
    node)
        ifname="${FP16_SDK_SLURM_IFNAME:-}"
        if [[ -n "$ifname" && "$ifname" != eth0 && -e /sys/class/net/eth0 ]]; then
            rename_interface "$ifname"
        fi
        exec /usr/sbin/slurmd -D
        ;;
    *)
        echo "unknown role '$role' (use controller or node)" >&2
        exit 2
        ;;
esac
