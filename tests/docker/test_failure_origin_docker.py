"""Local Docker names the host where a multi-host error began, not the first container to
exit (issue 33 item 6). Two containers of the real image over the job's network, a real Gloo
group: algo-2's rank raises, then lingers in an atexit hook after closing its connections, so
algo-1's rank fails on the lost peer and its container exits first."""

from __future__ import annotations

import uuid

import pytest

from fp16_sdk.errors import TrainingJobFailedError
from helpers.docker_engine import client  # noqa: F401 (the fixture)
from helpers.docker_engine import estimator

SCRIPT = """
    import atexit, datetime, os, time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    if os.environ["SM_CURRENT_HOST"] == "algo-2":
        def linger():
            dist.destroy_process_group()  # algo-1's recv fails now
            time.sleep(20)                # ...while this container is still running
        atexit.register(linger)
        raise ValueError("origin-93ab: the error began on algo-2")
    dist.recv(torch.zeros(1), src=1)
"""


@pytest.mark.docker
@pytest.mark.slow
def test_docker_job_names_the_host_where_the_error_began(client, tmp_path):
    est = estimator(tmp_path, SCRIPT, distribution={"torch_distributed": {"enabled": True}})
    name = f"origin-{uuid.uuid4().hex[:10]}"
    with pytest.raises(TrainingJobFailedError) as err:
        est.fit(job_name=name, logs=False)
    assert err.value.host == "algo-2", err.value
    assert "ErrorMessage: ValueError: origin-93ab" in err.value.reason
    # algo-2 was stopped by the backend (and SIGKILLed by its toolkit) after its own error:
    # said as such, without the out-of-memory hint.
    assert "Signal " in err.value.reason and "after-error" in err.value.reason
    assert "most often by the kernel's out-of-memory killer" not in err.value.reason
