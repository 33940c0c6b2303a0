#!/usr/bin/env bash
# A one-node Slurm GPU cluster on this host, the seed's FP16 job through it, then nothing left
# (issue 40 item 6). For a fresh root machine with NVIDIA GPUs, no Slurm, no munge and no
# package index (the GPU machine: Ubuntu 24.04, cgroup v2, no systemd):
#   1. unpack $FP16_SLURM_BUNDLE (container/slurm_bundle.sh: Debian 12's slurm-wlm 22.05 +
#      munge, relocatable) into $FP16_SLURM_PREFIX;
#   2. make this host's name resolve to an address one of its interfaces holds (the batch
#      script and NCCL's interface lookup need that; a VM without network gets 127.0.0.1, lo),
#      in a line put first in /etc/hosts and taken out at the end;
#   3. write slurm.conf + gres.conf (.ci/slurm-cluster.sh host-conf: controller and node = this
#      host, its CPUs; gres/gpu over /dev/nvidia0..N-1), moved into the prefix (root runs
#      the daemons, plugins from the prefix, munge's socket in the prefix, RealMemory = 90% of
#      this host's); start munged, slurmctld, slurmd (setsid nohup: they outlive the shell
#      line that started them until this script stops them); wait until sinfo shows the node idle;
#   4. CPU binding: task/cgroup (cgroup/v2 with IgnoreSystemd, ConstrainCores and
#      ConstrainDevices) is tried first where /sys/fs/cgroup is cgroup2, with one srun step as
#      the check; when that step fails the daemons are restarted with task/affinity
#      (sched_setaffinity, no cgroups), and the JSON says which one ran and why;
#   5. benchmarks/slurm_gpu.py: fit(instance_type="slurm", backend_options={"gpus_per_node":
#      N, "submit_command": []}) and the same job via fit(instance_type="local_process"),
#      into $OUT/slurm_gpu.json (losses, loss scales, skips, max abs diff, tokens/s, and what
#      the job's rank saw: CUDA_VISIBLE_DEVICES, NCCL_SOCKET_IFNAME, affinity, SLURM_*);
#   6. stop every daemon it started (and any slurmstepd of the prefix), restore /etc/hosts,
#      remove /run/slurm when it made it; `left_running` in the log says what remained (0).
# Usage (repository root, as root): bash benchmarks/slurm_gpu_host.sh   (results under $OUT)
#   env: FP16_SLURM_BUNDLE (.slurmgpu/slurm.tar.xz), FP16_SLURM_PREFIX (/opt/fp16-slurm),
#        PRESET (mid; tiny for a CPU rehearsal), STEPS (20), GPUS_PER_NODE (1),
#        FP16_SLURM_GPU_FILES + FP16_SLURM_GPU_COUNT (default: the /dev/nvidiaN files; stand-in
#        devices for a rehearsal), FP16_SLURM_TASK_PLUGIN (auto: task/cgroup where cgroup2, with
#        the fallback; try-cgroup: the same on any host; task/cgroup: no fallback;
#        task/affinity), JOB_LIMIT (seconds for both fit() runs, at most 170), TOTAL_LIMIT
#        (the whole script, 230: the runs get what is left), WHEELS (wheelhouse/gpu/deps),
#        OUT (benchmarks/results)
# Measured: the CPU rehearsal (tiny preset, a container without network) takes ~20 s.
set -uo pipefail
OUT=${OUT:-benchmarks/results}
BUNDLE=${FP16_SLURM_BUNDLE:-.slurmgpu/slurm.tar.xz}
P=${FP16_SLURM_PREFIX:-/opt/fp16-slurm}
GPUS=${GPUS_PER_NODE:-1}
TASK=${FP16_SLURM_TASK_PLUGIN:-auto}
mkdir -p "$OUT"
LOG="$OUT/slurm_gpu.log"
: > "$LOG"
start=$SECONDS
say() { echo "== $* (at $((SECONDS - start)) s)" | tee -a "$LOG"; }
die() { say "FAILED: $*"; exit 1; }
[[ $EUID -eq 0 ]] || die "run as root (the daemons run as root here)"
[[ -f "$BUNDLE" ]] || die "no Slurm bundle at $BUNDLE: make it with container/slurm_bundle.sh"
WHEELS=${WHEELS:-wheelhouse/gpu/deps} source benchmarks/device_env.sh
export SLURM_CONF="$P/etc/slurm.conf"
export PATH="$P/bin:$P/toolkit:$PATH"
host="$(hostname -s)"
made_run_slurm=0 added_alias=0 made_cgroups=()
[[ -e /run/slurm ]] || made_run_slurm=1

# ---- daemons ---------------------------------------------------------------------------------
daemon() {  # name, argv...: started in its own session, output in $P/log/<name>.log
    local name="$1"
    shift
    setsid nohup "$@" >>"$P/log/$name.log" 2>&1 </dev/null &
    echo $! > "$P/run/$name.pid"
}

prefix_pids() {  # every process running a binary of the prefix (daemons, slurmstepd)
    local d exe
    for d in /proc/[0-9]*; do
        exe="$(readlink "$d/exe" 2>/dev/null)" || continue
        [[ "$exe" == "$P"/* ]] && echo "${d#/proc/}"
    done
}

stop_daemons() {
    local pids n
    timeout 10 scancel --quiet --user=root >/dev/null 2>&1 || true
    for n in slurmd slurmctld munged; do
        [[ -s "$P/run/$n.pid" ]] && kill -TERM "$(cat "$P/run/$n.pid")" 2>/dev/null
        rm -f "$P/run/$n.pid"
    done
    for _ in $(seq 50); do
        pids="$(prefix_pids)"
        [[ -z "$pids" ]] && return 0
        sleep 0.2
    done
    say "still running after SIGTERM: $(echo $pids); SIGKILL"
    kill -KILL $pids 2>/dev/null
    sleep 0.5
}

teardown() {
    say "teardown"
    stop_daemons
    [[ -f "$P/hosts.orig" ]] && cat "$P/hosts.orig" > /etc/hosts && rm -f "$P/hosts.orig"
    ((made_run_slurm)) && rm -rf /run/slurm
    ((added_alias)) && alias_addr del
    local d
    for d in "${made_cgroups[@]}"; do  # cgroups Slurm made here, emptied by the stops above
        [[ -n "$d" && -d "$d" ]] && find "$d" -depth -type d -exec rmdir {} + 2>/dev/null
    done
    local left
    left="$(prefix_pids | wc -l)"
    say "left_running $left"
}
trap teardown EXIT

# ---- 1. the bundle ---------------------------------------------------------------------------
if [[ -d "$P" ]]; then  # an earlier run that was cut off: its daemons and /etc/hosts first
    [[ -n "$(prefix_pids)" ]] && { say "stopping an earlier run's daemons"; stop_daemons; }
    [[ -f "$P/hosts.orig" ]] && cat "$P/hosts.orig" > /etc/hosts
fi
say "unpacking $BUNDLE into $P"
rm -rf "$P"
mkdir -p "$P"
if command -v xz >/dev/null; then
    tar -xJf "$BUNDLE" -C "$P" || die "cannot unpack $BUNDLE"
else  # no xz-utils: Python's lzma reads it
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
        "$BUNDLE" "$P" || die "cannot unpack $BUNDLE"
fi
mkdir -p "$P/etc/munge" "$P/run/munge" "$P/var/munge" "$P/var/slurmctld" "$P/var/slurmd" \
    "$P/log" "$P/toolkit" "$P/work"
chmod 0700 "$P/etc/munge"
chmod 0755 "$P" "$P/run" "$P/run/munge"
# The toolkit's entry point (`train`, which the node script execs) from this checkout.
printf '#!/bin/sh\nexec python3 -m fp16_sdk.toolkit "$@"\n' > "$P/toolkit/train"
chmod 0755 "$P/toolkit/train"
missing="$(for f in "$P"/bin/* "$P"/sbin/* "$P"/lib/slurm/*.so; do
    ldd "$f" 2>/dev/null | grep 'not found'; done | sort -u)"
[[ -z "$missing" ]] || die "libraries missing on this host: $missing"
say "bundle: $(grep -E '^(slurmd|munge) ' "$P/MANIFEST" | paste -sd, -)"

# ---- 2. this host's name ---------------------------------------------------------------------
addresses() {  # "interface address" for every interface holding an IPv4 address
    python3 - <<'PY'
import fcntl, socket, struct
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _, name in socket.if_nameindex():
    try:
        raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
    except OSError:
        continue
    print(name, socket.inet_ntoa(raw[20:24]))
PY
}
alias_addr() {  # add|del: 127.0.13.1 on lo:fp16 (kernel ioctls: no iproute2 needed)
    python3 - "$1" <<'PY'
import fcntl, socket, struct, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
name = b"lo:fp16"
def req(addr):  # struct ifreq with a sockaddr_in, padded to its 40 bytes
    return struct.pack("16sH2s4s16s", name, socket.AF_INET, b"", socket.inet_aton(addr), b"")
if sys.argv[1] == "add":
    fcntl.ioctl(s, 0x8916, req("127.0.13.1"))       # SIOCSIFADDR
    fcntl.ioctl(s, 0x891C, req("255.255.255.255"))  # SIOCSIFNETMASK
else:  # an alias brought down is removed
    flags = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, struct.pack("16sH22s", name, 0, b""))[:18])[1]
    fcntl.ioctl(s, 0x8914, struct.pack("16sH22s", name, flags & ~1, b""))
PY
}
held="$(addresses)"
# Slurm's daemons find their listening address with getaddrinfo(AI_ADDRCONFIG), which answers
# nothing on a host whose only IPv4 address is 127.0.0.1 (glibc counts every other address,
# on lo too): such a host (a VM without network) gets 127.0.13.1 on lo:fp16 while Slurm runs.
added_alias=0
if ! awk '{print $2}' <<< "$held" | grep -qvx '127.0.0.1'; then
    alias_addr add || die "this host has no IPv4 address but 127.0.0.1, and adding 127.0.13.1 to lo failed (needs CAP_NET_ADMIN): Slurm's daemons cannot listen"
    added_alias=1
    say "only 127.0.0.1 here: 127.0.13.1 added on lo:fp16 (getaddrinfo's AI_ADDRCONFIG)"
fi
resolved="$(timeout 10 getent hosts "$(hostname)" | awk '{print $1; exit}')"
hosts_line=""
if [[ -z "$resolved" ]] || ! grep -qw -- "$resolved" <<< "$held"; then
    addr="$(awk '$1 != "lo" {print $2; exit}' <<< "$held")"
    addr="${addr:-127.0.0.1}"
    cp /etc/hosts "$P/hosts.orig"
    hosts_line="$addr $(hostname) $host"
    { echo "$hosts_line  # benchmarks/slurm_gpu_host.sh"; cat "$P/hosts.orig"; } > /etc/hosts
    say "$(hostname) resolved to '${resolved:-nothing}', held by no interface; /etc/hosts: $hosts_line"
fi
say "interfaces: $(echo $held); $(hostname) -> $(getent hosts "$(hostname)" | awk '{print $1; exit}')"

# ---- 3. configuration ------------------------------------------------------------------------
if [[ -n "${FP16_SLURM_GPU_FILES:-}" ]]; then
    gpu_files="$FP16_SLURM_GPU_FILES"
    n_gpus="${FP16_SLURM_GPU_COUNT:-1}"
else
    n_gpus="$(ls /dev/nvidia[0-9]* 2>/dev/null | wc -l)"
    ((n_gpus > 0)) || die "no /dev/nvidiaN here (set FP16_SLURM_GPU_FILES for stand-ins)"
    gpu_files="/dev/nvidia0"
    ((n_gpus > 1)) && gpu_files="/dev/nvidia[0-$((n_gpus - 1))]"
fi
mem_mb=$(( $(awk '/^MemTotal/ {print $2}' /proc/meminfo) / 1024 * 9 / 10 ))
cgroup_fs="$(stat -fc %T /sys/fs/cgroup 2>/dev/null)"

write_conf() {  # task plugin
    FP16_SDK_SLURM_GPUS="$n_gpus" FP16_SDK_SLURM_GPU_FILES="$gpu_files" \
        .ci/slurm-cluster.sh host-conf "$P/etc" 2>>"$LOG" || die "host-conf failed"
    local proctrack=proctrack/linuxproc
    [[ "$1" == task/cgroup ]] && proctrack=proctrack/cgroup
    sed -i -e "s|^SlurmUser=.*|SlurmUser=root|" \
        -e "s|^AuthInfo=\(.*\)|AuthInfo=\1,socket=$P/run/munge/munge.socket.2|" \
        -e "s|^StateSaveLocation=.*|StateSaveLocation=$P/var/slurmctld|" \
        -e "s|^SlurmdSpoolDir=.*|SlurmdSpoolDir=$P/var/slurmd|" \
        -e "s|^SlurmctldPidFile=.*|SlurmctldPidFile=$P/run/slurmctld.pidfile|" \
        -e "s|^SlurmdPidFile=.*|SlurmdPidFile=$P/run/slurmd.pidfile|" \
        -e "s|^ProctrackType=.*|ProctrackType=$proctrack|" \
        -e "s|^TaskPlugin=.*|TaskPlugin=$1|" \
        -e "s|RealMemory=2048|RealMemory=$mem_mb|" "$P/etc/slurm.conf"
    echo "PluginDir=$P/lib/slurm" >> "$P/etc/slurm.conf"
    if [[ "$1" == task/cgroup ]]; then  # no systemd here: Slurm makes its cgroups itself
        printf '%s\n' CgroupPlugin=cgroup/v2 IgnoreSystemd=yes CgroupAutomount=yes \
            ConstrainCores=yes ConstrainDevices=yes > "$P/etc/cgroup.conf"
    elif [[ "$cgroup_fs" == cgroup2fs ]]; then
        # slurmd 22.05 loads its cgroup/v2 plugin on a cgroup2 host whatever the task plugin,
        # and without this asks dbus (absent: no systemd) for a scope: seen on the GPU VM,
        # "cgroup_dbus_attach_to_scope: cannot connect to dbus", slurmd initialization failed
        printf '%s\n' CgroupPlugin=cgroup/v2 IgnoreSystemd=yes > "$P/etc/cgroup.conf"
    else
        rm -f "$P/etc/cgroup.conf"
    fi
}

start_cluster() {  # task plugin, seconds -> 0 when the node is idle within them
    write_conf "$1"
    rm -rf "$P/var/slurmctld/"* "$P/var/slurmd/"*
    daemon slurmctld "$P/sbin/slurmctld" -D -i -f "$SLURM_CONF"
    daemon slurmd "$P/sbin/slurmd" -D -f "$SLURM_CONF" -d "$P/sbin/slurmstepd"
    local out=""
    local deadline=$((SECONDS + $2))
    while ((SECONDS < deadline)); do
        out="$(sinfo -h -N -o '%N %t %G' 2>/dev/null | sort -u)"
        [[ "$out" == "$host idle "* ]] && { say "sinfo: $out ($1)"; return 0; }
        kill -0 "$(cat "$P/run/slurmd.pid")" 2>/dev/null &&
            kill -0 "$(cat "$P/run/slurmctld.pid")" 2>/dev/null || { out="a daemon exited"; break; }
        sleep 0.2
    done
    say "the node was not idle within $2 s with $1: ${out:-sinfo said nothing}"
    tail -n 15 "$P/log/slurmctld.log" "$P/log/slurmd.log" | tee -a "$LOG"
    return 1
}

smoke() {  # one srun step with the job's GPU request: what a task sees; CUDA must work there
    timeout 45 srun -N1 -n1 --exclusive --gpus-per-node="$GPUS" -t 2 python3 -c '
import os, sys
cuda = "no CUDA check (stand-in GPUs)"
if os.path.exists("/dev/nvidia0"):
    import torch
    n = torch.cuda.device_count()
    cuda = "torch sees %d GPU(s)" % n
    if n < 1:
        sys.exit("step: " + cuda)
    torch.ones(1, device="cuda").add_(1).item()
print("step CUDA_VISIBLE_DEVICES=%s CPUs=%d of %d SLURM_CPUS_ON_NODE=%s, %s" % (
    os.environ.get("CUDA_VISIBLE_DEVICES"), len(os.sched_getaffinity(0)), os.cpu_count(),
    os.environ.get("SLURM_CPUS_ON_NODE"), cuda))' >>"$LOG" 2>&1
}

start_munged() {
    daemon munged "$P/sbin/munged" -F --socket="$P/run/munge/munge.socket.2" \
        --key-file="$P/etc/munge/munge.key" --pid-file="$P/run/munge/munged.pidfile" \
        --log-file="$P/log/munged.file.log" --seed-file="$P/var/munge/munged.seed"
    for _ in $(seq 50); do [[ -S "$P/run/munge/munge.socket.2" ]] && break; sleep 0.1; done
    "$P/bin/munge" -n --socket="$P/run/munge/munge.socket.2" \
        | "$P/bin/unmunge" --socket="$P/run/munge/munge.socket.2" >/dev/null || {
        tail -5 "$P/log/munged.log" "$P/log/munged.file.log" | tee -a "$LOG"
        die "munge does not answer"; }
}

restart_with_affinity() {  # why: stop everything, start again with task/affinity
    task_reason="$1"
    say "$task_reason: task/affinity"
    stop_daemons
    rm -f "$P/run/munge/munge.socket.2"
    start_munged
    task=task/affinity
    start_cluster task/affinity 30 || die "slurmd/slurmctld did not come up"
    smoke || { tail -n 20 "$P/log/slurmd.log" | tee -a "$LOG"; die "an srun step failed"; }
}

run_jobs() {  # seconds -> the driver's status; both fit() runs into $OUT/slurm_gpu.json
    local extra
    extra="$(TASK_PLUGIN="$task" TASK_REASON="$task_reason" HOSTS_LINE="$hosts_line" \
        LO_ALIAS="$( ((added_alias)) && echo 127.0.13.1)" \
        CGROUP_FS="$cgroup_fs" PID1="$pid1" GRES="$(cat "$P/etc/gres.conf")" \
        SINFO="$(sinfo -h -N -o '%N %t %c CPUs %m MB %G' | sort -u)" \
        VERSION="$(grep -E '^slurmd ' "$P/MANIFEST")" \
        STEP="$(grep '^step ' "$LOG" | tail -1)" python3 -c '
import json, os
print(json.dumps({"slurm": {k.lower(): os.environ[k] for k in ("TASK_PLUGIN", "TASK_REASON",
    "HOSTS_LINE", "LO_ALIAS", "CGROUP_FS", "PID1", "GRES", "SINFO", "VERSION", "STEP")}}))')"
    say "fit() through Slurm ($task), then local_process (limit $1 s)"
    rm -rf "$P/work" && mkdir -p "$P/work"
    timeout "$1" python3 benchmarks/slurm_gpu.py --preset "${PRESET:-mid}" \
        --steps "${STEPS:-20}" --gpus-per-node "$GPUS" --work "$P/work" \
        --out "$OUT/slurm_gpu.json" --extra "$extra" 2>&1 | grep -v Warning | tee -a "$LOG"
    local status=${PIPESTATUS[0]} f
    if ((status != 0)); then
        say "slurm_gpu.py ended with status $status; the job's logs:"
        for f in "$P"/work/slurm/*/slurm/batch-*.out \
                 "$P"/work/slurm/*/slurm/attempt-*/node-*.log \
                 "$P/log/slurmctld.log" "$P/log/slurmd.log"; do
            [[ -f "$f" ]] && { echo "---- $f"; tail -n 25 "$f"; } | tee -a "$LOG"
        done
    fi
    return "$status"
}

left_s() {  # seconds left of TOTAL_LIMIT (230) less 15 for the teardown, at most JOB_LIMIT
    local left=$((${TOTAL_LIMIT:-230} - (SECONDS - start) - 15))
    ((left > ${JOB_LIMIT:-170})) && left=${JOB_LIMIT:-170}
    echo "$left"
}

say "munge key and munged"
head -c 1024 /dev/urandom > "$P/etc/munge/munge.key"
chmod 0400 "$P/etc/munge/munge.key"
start_munged

pid1="$(cat /proc/1/comm 2>/dev/null)"
cgroup_slices=(/sys/fs/cgroup/system.slice /sys/fs/cgroup/slurm)  # what cgroup/v2 may make
for d in "${cgroup_slices[@]}"; do [[ -e "$d" ]] && made_cgroups+=("") || made_cgroups+=("$d"); done
if [[ "$cgroup_fs" == cgroup2fs ]]; then
    # With IgnoreSystemd, slurmd puts slurmstepd's scope under system.slice, which a host
    # without systemd lacks ("Could not create scope directory ...: No such file or
    # directory" on the GPU VM), and wants the controllers it constrains enabled below the root
    mkdir -p /sys/fs/cgroup/system.slice 2>>"$LOG"
    for c in cpuset cpu memory; do
        echo "+$c" > /sys/fs/cgroup/cgroup.subtree_control 2>>"$LOG"
    done
fi
task_reason=""
if [[ "$TASK" == auto && "$cgroup_fs" == cgroup2fs ]] || [[ "$TASK" == task/cgroup ||
                                                            "$TASK" == try-cgroup ]]; then
    say "trying task/cgroup (cgroup/v2 without systemd: IgnoreSystemd=yes; PID 1 is $pid1)"
    if start_cluster task/cgroup 20 && smoke; then
        task=task/cgroup
    else
        why="task/cgroup did not run a step here: $(grep -E 'error|fatal' "$P/log/slurmd.log" \
            | tail -n 2 | cut -c1-200 | tr '\n' ' ')"
        [[ "$TASK" == task/cgroup ]] && die "$why"
        restart_with_affinity "$why"
    fi
else
    task=task/affinity
    task_reason="FP16_SLURM_TASK_PLUGIN=$TASK"
    [[ "$TASK" == auto ]] && task_reason="/sys/fs/cgroup is ${cgroup_fs:-missing}, not cgroup2"
    start_cluster task/affinity 30 || die "slurmd/slurmctld did not come up"
    smoke || { tail -n 20 "$P/log/slurmd.log" | tee -a "$LOG"; die "an srun step failed"; }
fi
grep '^step ' "$LOG" | tail -1

# ---- 5. the jobs -----------------------------------------------------------------------------
# Under task/cgroup the first try gets at most 120 s, so that a failure there (the cgroup
# path is the one this script could not rehearse) leaves time to run both jobs again under
# task/affinity. The whole script ends, daemons stopped, within TOTAL_LIMIT.
limit=$(left_s)
[[ "$task" == task/cgroup ]] && ((limit > 120)) && limit=120
run_jobs "$limit"
status=$?
if ((status != 0)) && [[ "$task" == task/cgroup && "$TASK" != task/cgroup ]] &&
        (($(left_s) >= 60)); then
    restart_with_affinity "fit() failed under task/cgroup (status $status)"
    run_jobs "$(left_s)"
    status=$?
fi
cp "$P/etc/slurm.conf" "$P/etc/gres.conf" "$OUT/" 2>/dev/null
say "done, status $status"
exit "$status"
