#!/usr/bin/env bash
# A restructure's no-behaviour-change check on one GPU, in one device call: the tree before it
# ($BEFORE: a `git archive` tarball, .tar or .tar.xz, carried beside this checkout) against this
# checkout, each run in a process of its own, alternating before/after/after/before so a drift
# of the machine shows as a spread rather than as a difference:
#   1. benchmarks/fp16_gpu.py --preset 1.3b --steps 20 --arms smp,smp_nn (four runs), then
#      --preset 350m --arms smp (after, before);
#   2. the GPU tier of this checkout (tests/gpu; the container cases are gpu_docker.sh's) and
#      the FP16 CUDA tests (fused optimizer, fused cross entropy, widening);
#   3. a summary: tokens/s per run and arm, the means after/before, peak memory, final losses
#      ($OUT/before_after.json).
# Usage (repository root): BEFORE=.before/before.tar.xz bash benchmarks/before_after_gpu.sh
#   env: OUT (default benchmarks/results), WHEELS (pydantic & co. for a machine without them),
#        STEPS (20), SKIP_TESTS=1 (the benchmark only)
set -uo pipefail
OUT=${OUT:-benchmarks/results}
STEPS=${STEPS:-20}
BEFORE=${BEFORE:?BEFORE names the tree before the change (a git archive tarball)}
mkdir -p "$OUT/before_after"
RESULTS=$(cd "$OUT/before_after" && pwd)  # absolute: the runs start in either tree
source benchmarks/device_env.sh
here=$PWD
tree=/tmp/before-tree
rm -rf "$tree" && mkdir -p "$tree" && tar -xf "$BEFORE" -C "$tree" || exit 1
LOG="$OUT/before_after/log.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$LOG"
status=0

bench() {  # which(before|after) label preset arms
    local dir=$here
    [[ $1 == before ]] && dir=$tree
    echo "== $2: $1, preset $3, arms $4" | tee -a "$LOG"
    (cd "$dir" && PYTHONPATH="${PYTHONPATH//$here/$dir}" timeout 300 python3 \
        benchmarks/fp16_gpu.py --preset "$3" --steps "$STEPS" --arms "$4" \
        --out "$RESULTS/$2.json") 2>&1 | tail -4 | tee -a "$LOG" || status=1
}

bench before before1 1.3b smp,smp_nn
bench after after1 1.3b smp,smp_nn
bench after after2 1.3b smp,smp_nn
bench before before2 1.3b smp,smp_nn
bench after after_350m 350m smp
bench before before_350m 350m smp

if [[ -z "${SKIP_TESTS:-}" ]]; then
    echo "== GPU tests (this checkout)" | tee -a "$LOG"
    timeout 150 python3 -m pytest tests/gpu -q -p no:cacheprovider \
        --ignore=tests/gpu/test_local_gpu_docker.py 2>&1 | tail -3 | tee -a "$LOG" || status=1
    timeout 150 python3 -m pytest tests/multiprocess/test_fp16_optimizer.py \
        tests/multiprocess/test_fp16_optimizer_fused.py \
        tests/unit/test_fused_loss.py tests/unit/test_widen.py -q -p no:cacheprovider \
        -k "cuda or fused or widen or fp16_module" 2>&1 | tail -3 | tee -a "$LOG" || status=1
fi

python3 - "$OUT/before_after" <<'EOF' | tee -a "$LOG"
import json, statistics, sys
from pathlib import Path
folder = Path(sys.argv[1])
runs = {}
for f in sorted(folder.glob("*.json")):
    if f.name == "summary.json":
        continue
    for result in json.loads(f.read_text())["results"]:
        for arm in result["arms"]:
            runs.setdefault(f.stem, {})[f"{result['preset']} {arm['arm']}"] = {
                k: arm.get(k) for k in ("tokens_per_s", "peak_mem_gib", "final_loss",
                                        "loss_scale", "skipped_steps")}
summary = {"runs": runs, "means": {}}
for key in sorted({k for r in runs.values() for k in r}):
    side = {w: [r[key]["tokens_per_s"] for n, r in runs.items() if n.startswith(w) and key in r]
            for w in ("before", "after")}
    if side["before"] and side["after"]:
        b, a = statistics.mean(side["before"]), statistics.mean(side["after"])
        summary["means"][key] = {"before": b, "after": a, "after_over_before": a / b,
                                 "before_spread": (max(side["before"]) - min(side["before"])) / b}
(folder / "summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary["means"], indent=1))
EOF
exit $status
