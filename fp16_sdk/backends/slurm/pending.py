"""Why a Slurm job waits, and what the user can change about it.

Slurm says why a job pends in squeue's Reason column (squeue(1) "JOB REASON CODES"). Some
reasons are only a wait (nodes busy); some mean the job will never start as submitted (a time
limit above the partition's, a held job, a request no node can meet). `pending_hint` turns the
reason into one console line that names the backend option to change.
"""

from __future__ import annotations

__all__ = ["pending_hint", "NEVER_STARTS"]

# Reasons under which the job does not start until someone changes something.
NEVER_STARTS = frozenset({
    "PartitionTimeLimit", "PartitionNodeLimit", "JobHeldUser", "JobHeldAdmin",
    "BadConstraints", "DependencyNeverSatisfied", "InvalidAccount", "InvalidQOS",
    "PartitionDown", "PartitionInactive", "AccountNotAllowed", "QOSNotAllowed",
    "ReqNodeNotAvail"})


def _hints(job_id: str, max_run: int, prefix: str) -> dict[str, str]:
    release = f"`{prefix}scontrol release {job_id}`"
    return {
        "PartitionTimeLimit": f"max_run={max_run}s is above the partition's time limit: set "
                              "backend_options['attempt_time_s'] to that limit (in seconds) "
                              "and the job continues in requeued jobs until max_run, or lower "
                              "max_run, or pick another partition",
        "PartitionNodeLimit": "instance_count is outside the partition's node limits (MinNodes/"
                              "MaxNodes, `scontrol show partition`): change instance_count or "
                              "backend_options['partition']",
        "JobHeldUser": f"the job is held: release it with {release}, or stop() it",
        "JobHeldAdmin": f"an administrator holds the job: ask them to run {release}",
        "BadConstraints": "no node can meet the request (CPUs, memory, GPUs, constraints): "
                          "check cpus_per_task, mem, gpus_per_node/gres and sbatch_args "
                          "against `sinfo -o '%N %c %m %G %f'`",
        "ReqNodeNotAvail": "the nodes it needs are down, drained or reserved (`sinfo -R`): "
                           "wait, or change sbatch_args (--nodelist, --exclude)",
        "Resources": "waiting for free nodes; a smaller instance_count or another partition "
                     "may start sooner",
        "Priority": "jobs of higher priority are ahead of it",
        "BeginTime": "waiting for its start time (a requeued job waits for Slurm's credential "
                     "lifetime before it starts again)",
        "Dependency": "waiting for the job it depends on",
        "DependencyNeverSatisfied": "the job it depends on failed: stop() this one",
        "PartitionDown": "the partition is down: pick another in backend_options['partition']",
        "PartitionInactive": "the partition is inactive: pick another in "
                             "backend_options['partition']",
        "InvalidAccount": "the account is not valid: fix backend_options['account']",
        "InvalidQOS": "the qos is not valid: fix backend_options['qos']",
    }


def pending_hint(job_id: str, reason: str, *, max_run: int, prefix: str = "") -> str:
    """One line: the job waits, Slurm's reason, and what to change.

    Args:
        job_id: the Slurm job id.
        reason: squeue's Reason ("Resources", "PartitionTimeLimit"...).
        max_run: the job's max_run (its --time), for the time-limit hint.
        prefix: the submit_command, joined, with a trailing space ("" on a login node).

    Returns:
        "Slurm job 12 is pending (PartitionTimeLimit): max_run=... ; ..."
    """
    hints = _hints(job_id, max_run, prefix)
    key = next((k for k in hints if reason.startswith(k)), None)
    what = hints[key] if key else f"see `{prefix}scontrol show job {job_id}`"
    if reason.startswith(("QOS", "Assoc")) and key is None:
        what = (f"a limit of its qos or account ({reason}) holds it: see `{prefix}scontrol "
                f"show job {job_id}` and `sacctmgr show qos`")
    never = " It will not start as it is." if reason in NEVER_STARTS else ""
    return f"Slurm job {job_id} is pending ({reason}): {what}.{never}"
