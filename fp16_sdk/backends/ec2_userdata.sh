#!/bin/bash
# fp16_sdk EC2 instance script (user data): runs one host of a training job, then shuts down.
#
# The SDK renders this template by replacing the settings line below with shell-quoted
# assignments; nothing else is substituted. Steps:
#   1. lay out /opt/ml from S3: config files the SDK wrote to <job>/ec2/config/<host>/, the
#      channel objects listed in that folder's manifest.tsv (the SDK did the sharding);
#   2. wait for <job>/ec2/hosts.json (algo-N -> private address, written by the SDK once every
#      instance has one) and pass it to the toolkit as FP16_SDK_HOST_ADDRESSES;
#   3. run `train` in the image ($FP16_SDK_RUNNER: run_container_docker pulls the image from
#      ECR unless present with pull policy "missing", uses --gpus all when nvidia-smi works;
#      run_train_direct runs `train` from this machine's PATH, for a container standing in
#      for the instance in tests);
#   4. upload model.tar.gz and output.tar.gz (algo-1), the log, and <job>/ec2/status/<host>.json;
#   5. shut down ($FP16_SDK_SHUTDOWN; the instance was launched to terminate on shutdown).
# The code itself is fetched by the toolkit from sagemaker_submit_directory, as on SageMaker.
# Credentials come from the instance profile (or the environment); none are written here.
# Nothing the user controls is run as shell code: the job's environment (env.tsv, base64
# values) reaches the training process as NAME=value arguments and never this script's
# variables; channel paths from manifest.tsv must stay inside their channel; every file list
# given to tar follows `--`.
set -u

# @@FP16_SDK_SETTINGS@@

for name in AWS_ENDPOINT_URL AWS_ENDPOINT_URL_S3 AWS_ENDPOINT_URL_ECR; do
    if [ -n "${!name:-}" ]; then export "${name?}"; fi  # so the toolkit and container see them
done
: "${FP16_SDK_RUNNER:=run_container_docker}"
: "${FP16_SDK_SHUTDOWN:=shutdown_instance}"
: "${ML_ROOT:=/opt/ml}"
: "${LOG_INTERVAL:=10}"
: "${HOSTS_TIMEOUT:=900}"
export AWS_DEFAULT_REGION="${AWS_DEFAULT_REGION:-$REGION}"
WORK="$(mktemp -d /tmp/fp16-sdk-job.XXXXXX)"
LOG="$WORK/$CURRENT_HOST.log"
STAGE="starting"
STATUS_WRITTEN=0
exec 3>&1 >>"$LOG" 2>&1  # fd 3: the console, which gets the whole log at the end

say() { echo "[fp16-sdk $(date -u +%H:%M:%S)] $*"; }

# s3 get|put SRC DST, or s3 get-list FILE (lines "s3-uri<TAB>local path"): the AWS CLI when
# installed, else Python's boto3 (one interpreter for a whole list).
s3() {
    if command -v aws >/dev/null 2>&1; then
        if [ "$1" = get-list ]; then
            local uri dest
            while IFS="$(printf '\t')" read -r uri dest; do
                mkdir -p "$(dirname "$dest")" && aws s3 cp --only-show-errors "$uri" "$dest" \
                    || return 1
            done < "$2"
            return 0
        fi
        aws s3 cp --only-show-errors "$2" "$3"
        return
    fi
    python3 - "$@" <<'PY'
import os
import sys
import boto3
from botocore.exceptions import ClientError
op, args = sys.argv[1], sys.argv[2:]
client = boto3.client("s3")
def split(uri):
    bucket, _, key = uri[len("s3://"):].partition("/")
    return bucket, key
try:
    if op == "get-list":
        with open(args[0]) as listing:
            for line in listing:
                uri, dest = line.rstrip("\n").split("\t")
                os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
                client.download_file(*split(uri), dest)
    elif op == "get":
        client.download_file(*split(args[0]), args[1])
    else:
        client.upload_file(args[0], *split(args[1]))
except ClientError as err:
    sys.exit(f"s3 {op} {' '.join(args)}: {err.response['Error'].get('Code')}")
PY
}

json_string() {  # stdin -> one JSON string body (no quotes)
    tr -d '\000-\010\013\014\016-\037' \
        | sed -e 's/\\/\\\\/g' -e 's/"/\\"/g' -e 's/\t/\\t/g' -e 's/\r/\\r/g' \
        | awk 'NR > 1 { printf "\\n" } { printf "%s", $0 }'
}

write_status() {  # status exit_code reason
    local reason
    reason="$(printf '%s' "$3" | head -c 1024 | json_string)"
    printf '{"host": "%s", "status": "%s", "exit_code": %s, "reason": "%s", "finished": %s}\n' \
        "$CURRENT_HOST" "$1" "$2" "$reason" "$(date +%s)" > "$WORK/status.json"
    s3 put "$LOG" "$JOB_URI/ec2/logs/$CURRENT_HOST.log" || true
    s3 put "$WORK/status.json" "$JOB_URI/ec2/status/$CURRENT_HOST.json" && STATUS_WRITTEN=1
}

on_exit() {
    code=$?
    [ -n "${LOG_LOOP:-}" ] && kill "$LOG_LOOP" 2>/dev/null
    if [ "$STATUS_WRITTEN" = 0 ]; then
        say "instance script stopped while $STAGE (exit $code)"
        write_status Failed "${code:-1}" "instance script failed while $STAGE (exit code $code)"
    fi
    cat "$LOG" >&3
    "$FP16_SDK_SHUTDOWN"
}
trap on_exit EXIT

fail() { say "$*"; exit 1; }

with_limit() {  # the job's MaxRuntimeInSeconds, as SageMaker's StoppingCondition
    if command -v timeout >/dev/null 2>&1; then timeout "$MAX_RUN" "$@"; else "$@"; fi
}

layout_opt_ml() {
    STAGE="laying out $ML_ROOT"
    mkdir -p "$ML_ROOT"/code "$ML_ROOT"/model "$ML_ROOT"/input/config "$ML_ROOT"/input/data \
        "$ML_ROOT"/output/data "$ML_ROOT"/output/intermediate "$ML_ROOT"/checkpoints || return 1
    local cfg="$JOB_URI/ec2/config/$CURRENT_HOST"
    s3 get "$cfg/manifest.tsv" "$WORK/manifest.tsv" || return 1
    STAGE="downloading the config files and input channels"
    local tab name channel uri rel count=0
    tab="$(printf '\t')"
    {
        for name in hyperparameters.json resourceconfig.json inputdataconfig.json; do
            echo "$cfg/$name$tab$ML_ROOT/input/config/$name"
        done
        echo "$cfg/env.tsv$tab$WORK/env.tsv"
        while IFS="$tab" read -r channel uri rel; do
            [ -n "$channel" ] || continue
            case "/$channel/$rel/" in  # the SDK checked these; an edited manifest is refused
                *"/../"*|*"/./"*|*"//"*)
                    STAGE="refusing manifest.tsv path $channel/$rel (it leaves its channel)"
                    say "$STAGE" >&2; exit 1 ;;
            esac
            echo "$uri$tab$ML_ROOT/input/data/$channel/$rel"
            count=$((count + 1))
        done < "$WORK/manifest.tsv"
    } > "$WORK/downloads.tsv"
    s3 get-list "$WORK/downloads.tsv" || return 1
    say "downloaded $count input objects"
    local iface
    iface="$(ip -o -4 route show to default 2>/dev/null | awk '{ print $5; exit }')"
    if [ -n "$iface" ]; then  # NCCL_SOCKET_IFNAME comes from network_interface_name
        sed -i "s/\"network_interface_name\": \"eth0\"/\"network_interface_name\": \"$iface\"/" \
            "$ML_ROOT/input/config/resourceconfig.json"
    fi
}

resolve_hosts() {
    STAGE="waiting for the other hosts' addresses"
    local waited=0
    until s3 get "$JOB_URI/ec2/hosts.json" "$WORK/hosts.json" 2>/dev/null; do
        [ "$waited" -lt "$HOSTS_TIMEOUT" ] || fail "no hosts.json after ${HOSTS_TIMEOUT}s"
        sleep 5
        waited=$((waited + 5))
    done
    s3 get "$JOB_URI/ec2/hosts.txt" "$WORK/hosts.txt" || return 1
    if [ -w /etc/hosts ]; then cat "$WORK/hosts.txt" >> /etc/hosts; fi
    FP16_SDK_HOST_ADDRESSES="$(cat "$WORK/hosts.json")"
    export FP16_SDK_HOST_ADDRESSES
    say "hosts: $FP16_SDK_HOST_ADDRESSES"
}

pull_image() {
    if [ "$PULL_POLICY" = missing ] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
        say "image $IMAGE is present; not pulling"
        return 0
    fi
    local registry="${IMAGE%%/*}"
    case "$registry" in
        *.dkr.ecr.*.amazonaws.com*)
            aws ecr get-login-password --region "$(echo "$registry" | cut -d. -f4)" \
                | docker login --username AWS --password-stdin "$registry" >/dev/null || return 1 ;;
    esac
    docker pull --quiet "$IMAGE"
}

run_container_docker() {
    STAGE="pulling $IMAGE"
    pull_image || return 1
    STAGE="training"
    local -a flags=() pair
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        flags+=(--gpus all)
    fi
    for pair in "${RUN_ENV[@]}"; do flags+=(-e "$pair"); done
    with_limit docker run --rm --name "fp16-sdk-$CURRENT_HOST" --network host --ipc host \
        "${flags[@]}" -v "$ML_ROOT:/opt/ml" "$IMAGE" train
}

run_train_direct() {
    STAGE="training"
    (cd / && with_limit env "${RUN_ENV[@]}" SAGEMAKER_BASE_DIR="$ML_ROOT" train)
}

tarball() {  # dir dest: the folder's contents at the archive root
    local -a names=()
    local name
    while IFS= read -r -d '' name; do names+=("$name"); done \
        < <(cd "$1" && find . -mindepth 1 -maxdepth 1 -printf '%P\0')
    if [ "${#names[@]}" = 0 ]; then (cd "$1" && tar -czf "$2" -T /dev/null); return; fi
    (cd "$1" && tar -czf "$2" -- "${names[@]}")  # `--`: a file named -x is a file
}

load_run_env() {  # RUN_ENV=(NAME=value ...): AWS settings, env.tsv's (base64), host list
    RUN_ENV=("AWS_DEFAULT_REGION=$AWS_DEFAULT_REGION")  # later entries win
    local name b64 value tab
    for name in AWS_ENDPOINT_URL AWS_ENDPOINT_URL_S3; do
        if [ -n "${!name:-}" ]; then RUN_ENV+=("$name=${!name}"); fi
    done
    tab="$(printf '\t')"
    while IFS="$tab" read -r name b64; do
        [ -n "$name" ] || continue
        [[ "$name" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || fail "env.tsv: bad variable name"
        value="$(printf '%s' "$b64" | base64 -d && printf x)" || fail "env.tsv: bad value of $name"
        RUN_ENV+=("$name=${value%x}")
    done < "$WORK/env.tsv"
    RUN_ENV+=("FP16_SDK_HOST_ADDRESSES=$FP16_SDK_HOST_ADDRESSES")
}

upload_artifacts() {
    STAGE="uploading artifacts"
    [ "$CURRENT_HOST" = algo-1 ] || return 0
    tarball "$ML_ROOT/model" "$WORK/model.tar.gz" || return 1
    s3 put "$WORK/model.tar.gz" "$OUTPUT_URI/output/model.tar.gz" || return 1
    if [ -n "$(ls -A "$ML_ROOT/output/data" 2>/dev/null)" ]; then
        tarball "$ML_ROOT/output/data" "$WORK/output.tar.gz" || return 1
        s3 put "$WORK/output.tar.gz" "$OUTPUT_URI/output/output.tar.gz" || return 1
    fi
}

shutdown_instance() { shutdown -h now 2>/dev/null || poweroff; }

main() {
    say "job $JOB_NAME, host $CURRENT_HOST, runner $FP16_SDK_RUNNER"
    layout_opt_ml || fail "could not lay out $ML_ROOT from $JOB_URI ($STAGE)"
    resolve_hosts || fail "could not resolve the hosts"
    load_run_env
    ( while sleep "$LOG_INTERVAL"; do
          s3 put "$LOG" "$JOB_URI/ec2/logs/$CURRENT_HOST.log" >/dev/null 2>&1
      done ) &
    LOG_LOOP=$!
    local code=0
    "$FP16_SDK_RUNNER" || code=$?
    say "train exited with $code"
    if [ "$code" = 0 ]; then
        upload_artifacts || fail "could not upload the artifacts to $OUTPUT_URI"
        write_status Completed 0 ""
        return 0
    fi
    local reason="exit code $code; see the log"
    [ "$code" = 124 ] && reason="MaxRuntimeInSeconds ($MAX_RUN) exceeded"
    [ -s "$ML_ROOT/output/failure" ] && reason="$(head -c 1024 "$ML_ROOT/output/failure")"
    write_status Failed "$code" "$reason"
}

main
