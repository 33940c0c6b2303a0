#!/bin/bash
# fp16_sdk EC2 instance script (user data): one host of a training job, then shutdown.
# The SDK replaces the settings line below with shell-quoted assignments (nothing else).
# Steps (docs/remote.md, "What happens"): lay out /opt/ml from <job>/ec2/config/<host>/;
# wait for ec2/hosts.json; run `train` ($FP16_SDK_RUNNER: in the image with docker, or
# run_train_direct for test stand-ins); success or failure, archive model/ and output/data/
# (algo-1 merges every host's, handed over in ec2/artifacts/<host>/); upload the log and
# ec2/status/<host>.json; shut down. No user value is run as shell code (env.tsv reaches
# training as NAME=value arguments; manifest paths stay in their channel; tar lists are
# verbatim). Nothing the container leaves in /opt/ml makes this script (root) read, archive
# or upload a file outside the job's folders: no link is followed to read the failure file
# or to archive a folder, and links inside that lead out of their folder (followed as the
# kernel follows them, chains included) are not archived.
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
: "${ARTIFACT_WAIT:=120}"  # how long hosts wait for each other's artifacts (SIGTERM's 120 s)
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
    # The instance's own interface (NCCL_SOCKET_IFNAME follows it): the toolkit takes it from
    # FP16_SDK_NETWORK_INTERFACE (contract.NETWORK_INTERFACE_VAR) over resourceconfig.json's
    # network_interface_name, so the SDK's file stays as written.
    HOST_IFACE="$(ip -o -4 route show to default 2>/dev/null | awk '{ print $5; exit }')"
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

archive_list() {  # dir list: NUL-separated entries of dir to archive, outside links left out
    local dir="$1" entry target resolved real
    real="$(realpath -- "$dir")"
    : > "$2"
    while IFS= read -r -d '' entry; do
        if [ -L "$dir/$entry" ]; then
            target="$(readlink -- "$dir/$entry")"
            # Where a reader lands: every link on the way followed, as the kernel does (a
            # lexical look is fooled by a chain: x -> sub/up/../../f with sub/up -> ..).
            resolved="$(realpath -m -- "$dir/$entry")"
            case "$target" in /*) resolved="/" ;; esac  # absolute: the host's, not the job's
            case "$resolved/" in
                "$real"/*) ;;
                *) say "not archiving ${dir#"$ML_ROOT"/}/$entry: a link to $target, outside" \
                       "${dir#"$ML_ROOT"/}"; continue ;;
            esac
        fi
        printf '%s\0' "$entry" >> "$2"
    done < <(cd "$dir" && find . -mindepth 1 -printf '%P\0')
}

real_dir() {  # path under ML_ROOT: 0 if a directory with no link on its way from ML_ROOT
    local p="$1"
    while [ "$p" != "$ML_ROOT" ] && [ "$p" != / ] && [ "$p" != . ]; do
        [ -L "$p" ] && return 1
        p="$(dirname -- "$p")"
    done
    [ -d "$1" ]
}

tarball() {  # dir dest: the folder's contents at the archive root (an uncompressed tar)
    local dir list="$2.list"
    dir="$(realpath -s -- "$1")"
    archive_list "$dir" "$list" || return 1
    # exactly the listed entries; a name like -x is a file; links stay links (no -h)
    tar -cf "$2" -C "$dir" --no-recursion --null --verbatim-files-from -T "$list"
}

make_part() {  # kind dir: this host's part of the <kind> archive, $WORK/parts/<host>.<kind>.tar
    mkdir -p "$WORK/parts"
    local dest="$WORK/parts/$CURRENT_HOST.$1.tar" empty="$WORK/parts/.empty"
    if [ -e "$2" ] || [ -L "$2" ]; then
        if ! real_dir "$2"; then
            local where="${2#"$ML_ROOT"/}"
            ARTIFACT_PROBLEM="refusing to archive $where: the training container left a link"
            ARTIFACT_PROBLEM+=" ($where -> $(readlink -- "$2" || echo '?'), or one on its path)"
            ARTIFACT_PROBLEM+=" where the folder should be"
            return 1
        fi
        tarball "$2" "$dest"
        return
    fi
    mkdir -p "$empty" && tarball "$empty" "$dest"  # the container removed it: nothing to add
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
    if [ -n "${HOST_IFACE:-}" ]; then RUN_ENV+=("FP16_SDK_NETWORK_INTERFACE=$HOST_IFACE"); fi
}

host_names() {  # every host of the job, algo-1 first
    grep -o '"algo-[0-9]*"' "$WORK/hosts.json" | tr -d '"' | sort -u -t- -k2,2n
}

wait_for() {  # uri [seconds]: 0 once the object exists (within ARTIFACT_WAIT), else 1
    local waited=0
    until s3 get "$1" "$WORK/.probe" >/dev/null 2>&1; do
        [ "$waited" -lt "${2:-$ARTIFACT_WAIT}" ] || return 1
        sleep 2
        waited=$((waited + 2))
    done
}

hand_over_artifacts() {  # not algo-1: this host's parts, for algo-1 to merge
    local kind base="$JOB_URI/ec2/artifacts/$CURRENT_HOST"
    for kind in model output; do
        s3 put "$WORK/parts/$CURRENT_HOST.$kind.tar" "$base/$kind.tar" || return 1
    done
    printf '{}' > "$WORK/done.json" && s3 put "$WORK/done.json" "$base/done.json"
}

merge_artifacts() {  # status: every host's parts into the job's model.tar.gz, output.tar.gz
    local host kind part merged limit="$ARTIFACT_WAIT"
    local -a others=()
    [ "$1" = Completed ] && limit="$HOSTS_TIMEOUT"  # the job ends with its slowest host anyway
    while IFS= read -r host; do
        [ "$host" = algo-1 ] && continue
        if wait_for "$JOB_URI/ec2/artifacts/$host/done.json" "$limit"; then
            others+=("$host")
        else
            say "no artifacts from $host within ${limit}s; the archives hold the others'"
        fi
    done < <(host_names)
    for kind in model output; do
        merged="$WORK/$kind.tar"
        cp -- "$WORK/parts/algo-1.$kind.tar" "$merged" || return 1
        for host in "${others[@]}"; do
            part="$WORK/parts/$host.$kind.tar"
            s3 get "$JOB_URI/ec2/artifacts/$host/$kind.tar" "$part" || return 1
            # next host's members in front: a clash is extracted last from the lowest host
            tar -A -f "$part" -- "$merged" && mv -- "$part" "$merged" || return 1
        done
        [ "$kind" = output ] && [ -z "$(tar -tf "$merged" | head -c 1)" ] && continue
        gzip -c -- "$merged" > "$merged.gz" || return 1
        s3 put "$merged.gz" "$OUTPUT_URI/output/$kind.tar.gz" || return 1
    done
}

upload_artifacts() {  # status: uploads whether training succeeded or failed, as SageMaker
    STAGE="uploading artifacts"
    ARTIFACT_PROBLEM="could not archive or upload the artifacts to $OUTPUT_URI"
    make_part model "$ML_ROOT/model" || return 1
    make_part output "$ML_ROOT/output/data" || return 1
    if [ "$CURRENT_HOST" = algo-1 ]; then
        merge_artifacts "$1"
        return
    fi
    hand_over_artifacts || return 1
    # a Failed status ends the job (every instance terminated): let algo-1 merge first
    if [ "$1" != Completed ] && ! wait_for "$JOB_URI/ec2/status/algo-1.json"; then
        say "algo-1 did not finish within ${ARTIFACT_WAIT}s; reporting this host's failure"
    fi
    return 0
}

read_failure() {  # the first 1024 bytes of output/failure, when it is a regular file reached
    local f="$ML_ROOT/output/failure"  # by no link (the container may have left links)
    if [ -L "$ML_ROOT/output" ] || [ -L "$f" ]; then
        echo "the training container left a link at ${f#"$ML_ROOT"/} or its folder: not read"
    elif [ -f "$f" ] && [ -s "$f" ]; then
        dd if="$f" bs=1024 count=1 iflag=nofollow,nonblock status=none
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
    local code=0 status=Completed reason="" failure
    "$FP16_SDK_RUNNER" || code=$?
    say "train exited with $code"
    if [ "$code" != 0 ]; then
        status=Failed reason="exit code $code; see the log"
        [ "$code" = 124 ] && reason="MaxRuntimeInSeconds ($MAX_RUN) exceeded"
        failure="$(read_failure)"
        [ -n "$failure" ] && reason="$failure"
    fi
    if ! upload_artifacts "$status"; then
        say "$ARTIFACT_PROBLEM"
        if [ "$status" = Completed ]; then status=Failed code=1 reason="$ARTIFACT_PROBLEM"; fi
    fi
    write_status "$status" "$code" "$reason"
}

main
