#!/bin/bash
# A submit_command wrapper for the tests: records each Slurm command line in LOG, and answers
# sbatch DELAY seconds late (after sbatch has submitted), as a busy controller or a slow login
# does. Usage: count_and_delay.sh LOG DELAY PREFIX... COMMAND...
log="$1" delay="$2"
shift 2
printf '%s\n' "$*" >> "$log"
case " $* " in
    *" sbatch "*) "$@"; rc=$?; sleep "$delay"; exit "$rc" ;;
esac
exec "$@"
