#!/usr/bin/env bash
# The whole local_gpu check on a GPU machine (issue 40), one command: engine, image, runs.
#   1. engine: the running Docker engine, else Debian's engine binaries from $DOCKER_BUNDLE
#      (container/docker_bundle.sh makes it on a Debian machine) started here: containerd, then
#      dockerd without iptables or the default bridge (the GPU machine's VM has neither).
#      Whether the engine can make a job's bridge network is probed; if not, jobs run with
#      backend_options={"network": "host"} (one instance, as on SageMaker's own instances).
#   2. image: container/build_gpu_base_image.sh (this machine's own CUDA PyTorch, no registry),
#      then container/build_image.sh gpu --no-download with dependency wheels made elsewhere
#      ($WHEELHOUSE/gpu/deps: container/build_image.sh gpu --deps-only --python-version 3.12).
#   3. bench: benchmarks/gpu_docker.py (the seed's FP16 job, local_gpu vs local_process, first
#      step three ways, import times on the host and in the image, the SIGKILL test).
#   4. aws: AWS's train_gpt_simple.py (aws/amazon-sagemaker-examples 198c0bd66^, unmodified;
#      never in this repository: staged in the ignored .awsgpu/ with its wheels and a driver
#      script) through local_gpu, a checkpoint, then a resumed job.
#   5. tests: the GPU tier (tests/gpu, the container path included).
# Usage (repository root, as root): bash benchmarks/gpu_docker.sh    (results under $OUT)
#   env: PARTS (default engine,image,bench,aws,tests), DOCKER_BUNDLE (default
#        .dockerbin/docker.tar.xz), WHEELHOUSE (default wheelhouse), EXCLUDE (paths the base
#        image leaves out), PRESET (1.3b), STEPS (30), OUT (benchmarks/results)
set -uo pipefail
OUT=${OUT:-benchmarks/results}
PARTS=",${PARTS:-engine,image,bench,aws,tests},"
WHEELHOUSE=${WHEELHOUSE:-wheelhouse}
BUNDLE=${DOCKER_BUNDLE:-.dockerbin/docker.tar.xz}
want() { [[ "$PARTS" == *",$1,"* ]]; }
mkdir -p "$OUT"
LOG="$OUT/gpu_docker.log"
start=$SECONDS
say() { echo "== $* (at $((SECONDS - start)) s)" | tee -a "$LOG"; }
WHEELS="$WHEELHOUSE/gpu/deps" source benchmarks/device_env.sh
status=0

if want engine && ! docker info >/dev/null 2>&1; then
    say "engine from $BUNDLE"
    tar -xJf "$BUNDLE" -C /usr/local && ldconfig
    setsid nohup containerd >/tmp/containerd.log 2>&1 < /dev/null &
    for _ in $(seq 30); do [[ -S /run/containerd/containerd.sock ]] && break; sleep 0.5; done
    setsid nohup dockerd --containerd /run/containerd/containerd.sock --iptables=false \
        --bridge=none --userland-proxy=false --storage-driver=overlay2 \
        >/tmp/dockerd.log 2>&1 < /dev/null &
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
    docker info >/dev/null 2>&1 || { tail -20 /tmp/dockerd.log | tee -a "$LOG"; exit 1; }
fi
docker version --format 'engine {{.Server.Version}}' | tee -a "$LOG"
network=bridge
if docker network create fp16-sdk-probe >/dev/null 2>>"$LOG"; then
    docker network rm fp16-sdk-probe >/dev/null
else
    network=host
fi
echo "job network: $network" | tee -a "$LOG"

if want image; then
    say "GPU base image from this machine's install"
    EXCLUDE="${EXCLUDE-/opt/nvidia}" bash container/build_gpu_base_image.sh 2>&1 | tail -5 | tee -a "$LOG" || status=1
    say "GPU training image"
    bash container/build_image.sh gpu --no-download 2>&1 | tail -3 | tee -a "$LOG" || status=1
    docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep fp16 | tee -a "$LOG"
fi

if want bench; then
    say "gpu_docker.py"
    timeout "${BENCH_LIMIT:-420}" python3 benchmarks/gpu_docker.py --preset "${PRESET:-1.3b}" \
        --steps "${STEPS:-30}" --network "$network" --kill-test --import-runs "${IMPORT_RUNS:-3}" \
        --image-python fp16-sdk-training:latest-gpu --out "$OUT/gpu_docker.json" 2>&1 \
        | grep -v Warning | tee -a "$LOG" || status=1
fi

if want aws && [[ -f .awsgpu/run_gpu.py ]]; then  # AWS's train_gpt_simple.py, carried in
    say "AWS train_gpt_simple.py through local_gpu: train, checkpoint, resume"
    timeout "${AWS_LIMIT:-400}" python3 .awsgpu/run_gpu.py local_gpu "$OUT/awsgpu_summary.json" \
        --network "$network" 2>&1 | grep -v 'skipping batch' | tail -40 | tee -a "$LOG" \
        || status=1
fi

if want tests; then
    say "GPU tier"
    FP16_SDK_GPU_NETWORK=$network timeout "${TESTS_LIMIT:-240}" python3 -m pytest tests/gpu \
        -q -p no:cacheprovider 2>&1 | tail -15 | tee -a "$LOG" || status=1
fi
leftover=$(docker ps -aq --filter label=fp16_sdk.job | wc -l)
echo "containers of jobs left: $leftover" | tee -a "$LOG"
say "done, status $status"
exit $status
