#!/usr/bin/env bash
# Pack a one-node Slurm (slurmctld, slurmd, the clients) and munge to carry to a machine that
# has neither and no package index (the GPU machine of benchmarks/slurm_gpu_host.sh): Debian
# 12's slurm-wlm 22.05 and munge 0.5.15, fetched with this machine's apt configuration, with
# every library they link except glibc's own (so a newer glibc host, Ubuntu 24.04's 2.39,
# needs nothing installed). Needs a Debian 12 machine with patchelf.
#
# Layout, relocatable (each ELF file finds its libraries through a RUNPATH relative to
# $ORIGIN, so nothing is put on LD_LIBRARY_PATH, and the jobs' processes, which inherit the
# submitting shell's environment, never load these libraries):
#   bin/    sbatch srun squeue scontrol scancel sinfo sacct salloc sattach sstat munge unmunge
#   sbin/   slurmctld slurmd slurmstepd munged mungekey
#   lib/    the libraries; lib/slurm/ the plugins and libslurmfull.so (PluginDir)
#   MANIFEST  the packages and versions, one 'package version' a line
# Every ELF file's needs are checked to resolve inside the bundle or to glibc before packing.
#
# Usage: container/slurm_bundle.sh [OUT]     (default OUT: .slurmgpu/slurm.tar.xz)
set -euo pipefail
out="$(realpath -m "${1:-.slurmgpu/slurm.tar.xz}")"
command -v patchelf >/dev/null || { echo "patchelf is missing: apt-get install patchelf" >&2; exit 1; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
packages=(slurmctld slurmd slurm-client slurm-wlm-basic-plugins munge libmunge2
          libhwloc15 libudev1 libnuma1 liblz4-1 libjson-c5 libyaml-0-2 liblua5.1-0
          libdbus-1-3 libsystemd0 libcap2 libzstd1 liblzma5 libpam0g libaudit1 libcap-ng0
          libreadline8 libtinfo6 libgcrypt20 libgpg-error0 libbz2-1.0 zlib1g)
apt-get download "${packages[@]}" >/dev/null 2>&1
for deb in *.deb; do
    dpkg -x "$deb" x
    dpkg-deb --showformat='${Package} ${Version}\n' -W "$deb" >> MANIFEST
done
b="$work/b"
mkdir -p "$b/bin" "$b/sbin" "$b/lib/slurm"
for c in sbatch srun squeue scontrol scancel sinfo sacct salloc sattach sstat munge unmunge; do
    cp -L "x/usr/bin/$c" "$b/bin/"
done
for d in slurmctld slurmd slurmstepd; do cp -L "x/usr/sbin/$d-wlm" "$b/sbin/$d"; done
cp -L x/usr/sbin/munged x/usr/sbin/mungekey "$b/sbin/"
# The plugins; PMIx's need libpmix, which no node here has (MpiDefault=none).
cp -L x/usr/lib/x86_64-linux-gnu/slurm-wlm/*.so "$b/lib/slurm/"
rm -f "$b"/lib/slurm/mpi_pmix*.so
for lib in x/usr/lib/x86_64-linux-gnu/*.so.* x/lib/x86_64-linux-gnu/*.so.*; do
    [[ -e "$lib" ]] || continue
    cp -L "$lib" "$b/lib/"
done
# Keep only the soname files (libz.so.1, not libz.so.1.2.13 as well).
rm -f "$b"/lib/liblua5.1-c++.so.*  # the C++ build of Lua: no plugin links it
for f in "$b"/lib/*.so.*; do
    soname="$(patchelf --print-soname "$f" 2>/dev/null || true)"
    if [[ -n "$soname" && "$soname" != "$(basename "$f")" ]]; then
        [[ -e "$b/lib/$soname" ]] || mv "$f" "$b/lib/$soname"
        rm -f "$f"
    fi
done
cp MANIFEST "$b/"
# RUNPATHs relative to each file, then strip what no one runs.
for f in "$b"/bin/* "$b"/sbin/*; do patchelf --set-rpath '$ORIGIN/../lib/slurm:$ORIGIN/../lib' "$f"; done
for f in "$b"/lib/slurm/*.so; do patchelf --set-rpath '$ORIGIN:$ORIGIN/..' "$f"; done
for f in "$b"/lib/*.so.*; do patchelf --set-rpath '$ORIGIN' "$f"; done
# glibc's own libraries (the host's, never carried): anything else must be in lib/.
glibc='^(libc|libm|libresolv|libpthread|libdl|librt|libutil|ld-linux-x86-64)\.so'
missing=0
for f in "$b"/bin/* "$b"/sbin/* "$b"/lib/slurm/*.so "$b"/lib/*.so.*; do
    for need in $(patchelf --print-needed "$f"); do
        [[ "$need" =~ $glibc || -e "$b/lib/$need" || -e "$b/lib/slurm/$need" ]] && continue
        echo "$f needs $need, which is not in the bundle" >&2
        missing=1
    done
done
((missing == 0)) || exit 1
mkdir -p "$(dirname "$out")"
XZ_OPT=-9e tar -C "$b" -cJf "$out" .
echo "$out: $(du -h "$out" | cut -f1), $(find "$b" -type f | wc -l) files, libraries:" \
     "$(ls "$b/lib" | grep -v '^slurm$' | tr '\n' ' ')"
