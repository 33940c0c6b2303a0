#!/bin/bash
# Entrypoint of the test cluster's node image: munged, then the role's Slurm daemon in the
# foreground (PID 1 is docker's init, started with `docker run --init`, which reaps orphans).
#
# Usage: fp16-slurm-node controller|node
#   controller: sshd (root, key login) and slurmctld; node: slurmd (NodeName = the hostname).
# Reads /etc/fp16-slurm/ (the cluster's state folder, mounted read-only): munge.key and, for
# the controller, id_ed25519.pub (authorised for root). env: FP16_SDK_SLURM_MIN_JOB_AGE.
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

sed -e "s/@CPUS@/$(nproc)/" -e "s/@MIN_JOB_AGE@/$min_job_age/" \
    /etc/slurm/slurm.conf.in > /etc/slurm/slurm.conf

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
        exec /usr/sbin/slurmd -D
        ;;
    *)
        echo "unknown role '$role' (use controller or node)" >&2
        exit 2
        ;;
esac
