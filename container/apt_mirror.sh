#!/usr/bin/env bash
# Print this machine's Debian mirror for a suite: the first non-security URI that serves it,
# read at run time from /etc/apt (deb822 *.sources or one-line *.list files), or $DEBIAN_MIRROR.
# Exit status 1, with a message naming the fix, when there is none.
#
# Usage: container/apt_mirror.sh [SUITE]      (default SUITE: bookworm)
# Used by build_base_image.sh (debootstrap) and slurm/build.sh (apt inside the node image).
set -euo pipefail

suite="${1:-bookworm}"

from_sources() {
    local f
    shopt -s nullglob
    for f in /etc/apt/sources.list.d/*.sources; do
        awk -v suite="$suite" 'BEGIN { RS = ""; FS = "\n" }
            {
                uris = ""; ok = 0
                for (i = 1; i <= NF; i++) {
                    if ($i ~ /^URIs:/) { uris = $i; sub(/^URIs:[ \t]*/, "", uris) }
                    if ($i ~ /^Suites:/) {
                        n = split($i, s, /[ \t]+/)
                        for (j = 2; j <= n; j++) if (s[j] == suite) ok = 1
                    }
                }
                split(uris, u, /[ \t]+/)
                if (ok && u[1] != "" && u[1] !~ /security/) { print u[1]; exit }
            }' "$f"
    done
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [[ -f "$f" ]] || continue
        awk -v suite="$suite" '$1 == "deb" {
                i = 2; if ($i ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
                if ($(i + 1) == suite && $i !~ /security/) { print $i; exit }
            }' "$f"
    done
}

mirror="${DEBIAN_MIRROR:-$(from_sources | head -n 1)}"
if [[ -z "$mirror" ]]; then
    echo "no apt mirror for $suite found in /etc/apt; set DEBIAN_MIRROR=<url of a Debian mirror>" >&2
    exit 1
fi
echo "$mirror"
