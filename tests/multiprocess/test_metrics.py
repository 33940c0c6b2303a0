"""metric_definitions applied to job logs (fp16_sdk.metrics).

Pure tests compare with tables written out by hand; one test runs a real local_process job
whose script prints known values and checks the table read back from its logs.
"""

from __future__ import annotations

import csv
import datetime
import textwrap

import pytest

from fp16_sdk.backends import job_folder
from fp16_sdk.errors import ConfigError
from fp16_sdk.metrics import (COLUMNS, MetricRecord, MetricsTable, TrainingJobAnalytics,
                              job_metrics, parse_metrics)
from fp16_sdk.pytorch import PyTorch

DEFS = [{"Name": "train:loss", "Regex": r"loss ([0-9.eE+-]+)"},
        {"Name": "train:loss_scale", "Regex": r"loss_scale ([0-9.]+)"}]

LOG = [
    "algo-1 | [toolkit] starting",
    "algo-1 | step 5 loss 5.5000 loss_scale 65536 skipped 1",
    "algo-2 | unrelated line loss nan",
    "algo-1 | step 10 loss 4.25 loss_scale 32768 skipped 2",
]


def test_records_in_log_order_hand_table():
    table = parse_metrics(LOG, DEFS)
    # "loss (...)" needs a space after "loss", so it does not fire inside "loss_scale 65536";
    # "loss nan" is no number for the loss regex's character class.
    assert table.to_rows() == [
        {"timestamp": None, "metric_name": "train:loss", "value": 5.5},
        {"timestamp": None, "metric_name": "train:loss_scale", "value": 65536.0},
        {"timestamp": None, "metric_name": "train:loss", "value": 4.25},
        {"timestamp": None, "metric_name": "train:loss_scale", "value": 32768.0},
    ]
    assert table["host"] == ["algo-1"] * 4
    assert table.columns == COLUMNS == ("timestamp", "metric_name", "value")
    assert table.series("train:loss") == [5.5, 4.25]
    assert table.metric_names() == ["train:loss", "train:loss_scale"]
    assert table["value"] == [5.5, 65536.0, 4.25, 32768.0]
    assert len(table.where("train:loss_scale")) == 2
    assert isinstance(table[1:3], MetricsTable) and table[0] == MetricRecord(
        None, "train:loss", 5.5, "algo-1")


def test_final_agrees_with_job_folder_final_metrics():
    assert parse_metrics(LOG, DEFS).final() == [{"MetricName": "train:loss", "Value": 4.25},
                                                {"MetricName": "train:loss_scale",
                                                 "Value": 32768.0}]
    # job_folder.final_metrics keeps NaN: compare on the lines it and we agree on.
    clean = [ln for ln in LOG if "nan" not in ln]
    assert parse_metrics(clean, DEFS).final() == job_folder.final_metrics(clean, DEFS)


def test_anchored_regex_sees_the_message_without_host_prefix():
    defs = [{"Name": "epoch", "Regex": r"^epoch=(\d+)"}]
    table = parse_metrics(["algo-3 | epoch=7", "algo-3 | no epoch=8", "epoch=9"], defs)
    assert table.to_rows() == [{"timestamp": None, "metric_name": "epoch", "value": 7.0},
                               {"timestamp": None, "metric_name": "epoch", "value": 9.0}]
    assert table["host"] == ["algo-3", None]


def test_every_match_counts_whole_match_without_group_non_numbers_skipped():
    defs = [{"Name": "acc", "Regex": r"acc=(\S+)"}, {"Name": "bare", "Regex": r"\d+\.\d+"}]
    table = parse_metrics(["acc=0.5 acc=oops acc=0.75"], defs)
    assert table.series("acc") == [0.5, 0.75]
    assert table.series("bare") == [0.5, 0.75]
    # CloudWatch stores neither NaN nor infinity: both are skipped.
    odd = parse_metrics(["loss nan", "loss inf", "loss -1e3"], [{"Name": "l", "Regex": r"loss (\S+)"}])
    assert odd.series("l") == [-1000.0]


def test_timestamps_are_seconds_since_first_line():
    lines = [(1000.0, "algo-1 | start"), (1002.5, "algo-1 | loss 3.0"),
             (1010.0, "algo-2 | loss 2.0")]
    table = parse_metrics(lines, DEFS[:1])
    assert table["timestamp"] == [2.5, 10.0]
    assert table["host"] == ["algo-1", "algo-2"]
    assert parse_metrics(lines, DEFS[:1], start_time=990.0)["timestamp"] == [12.5, 20.0]


@pytest.mark.parametrize("bad, words", [
    ([{"Name": "x", "Regex": "loss ([0-9"}], ["'x'", "loss ([0-9", "valid regex"]),
    ([{"Name": "x"}], ["{'Name': 'x'}", "'Regex': str"]),
])
def test_bad_definitions_name_the_entry(bad, words):
    with pytest.raises(ConfigError) as err:
        parse_metrics(["loss 1"], bad)
    for word in words:
        assert word in str(err.value)


def test_unknown_column_is_a_clear_key_error():
    with pytest.raises(KeyError, match="'step' is not a column; the columns are timestamp"):
        parse_metrics(LOG, DEFS)["step"]


def test_csv_export(tmp_path):
    out = tmp_path / "m.csv"
    parse_metrics(LOG, DEFS).to_csv(str(out))
    rows = list(csv.reader(out.open()))
    assert rows[0] == list(COLUMNS)
    assert rows[1] == ["", "train:loss", "5.5"] and len(rows) == 5


class _Handle:
    """The part of JobHandle the metrics read: name, log_records(), spec-less describe()."""

    name = "job-1"

    def __init__(self, records):
        self._records = records

    def log_records(self):
        return list(self._records)

    def describe(self):
        return {"AlgorithmSpecification": {"MetricDefinitions": DEFS},
                "TrainingStartTime": datetime.datetime.fromtimestamp(4.0, datetime.timezone.utc)}


def test_analytics_reads_definitions_from_describe_and_filters_names():
    job = _Handle([(5.0, LOG[1]), (9.0, LOG[3])])
    analytics = TrainingJobAnalytics(job, metric_names=["train:loss_scale"])
    assert analytics.name == "job-1"
    assert analytics.table().to_rows() == [
        {"timestamp": 1.0, "metric_name": "train:loss_scale", "value": 65536.0},
        {"timestamp": 5.0, "metric_name": "train:loss_scale", "value": 32768.0}]
    job._records.append((12.0, "algo-1 | loss 1.0 loss_scale 16384"))
    assert len(analytics.table()) == 2  # cached
    assert analytics.table(force_refresh=True).series("train:loss_scale")[-1] == 16384.0
    frame = analytics.dataframe()
    try:
        import pandas  # noqa: F401
        assert list(frame.columns) == list(COLUMNS)
    except ModuleNotFoundError:
        assert isinstance(frame, MetricsTable)
    with pytest.raises(ConfigError, match="'val:acc' has no metric definition"):
        TrainingJobAnalytics(job, metric_names=["val:acc"])


SCRIPT = textwrap.dedent("""
    import os
    for step, loss in enumerate([2.0, 1.5, 1.25], start=1):
        print(f"step {step} loss {loss} loss_scale {2 ** (16 - step)}", flush=True)
    print("host", os.environ["SM_CURRENT_HOST"], "done")
""")


def test_real_local_process_job_metrics(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text(SCRIPT)
    est = PyTorch(entry_point="train.py", source_dir=str(tmp_path / "src"),
                  framework_version="2.1.0", py_version="py311", instance_type="local_process",
                  instance_count=2, output_path=f"file://{tmp_path}/jobs",
                  metric_definitions=DEFS)
    est.fit(logs="None")
    job = est.latest_training_job
    table = job_metrics(job)
    # Both hosts run the script: each value appears once per host, in each host's own order.
    for host in ("algo-1", "algo-2"):
        mine = [r for r in table if r.host == host]
        assert [r.value for r in mine if r.metric_name == "train:loss"] == [2.0, 1.5, 1.25]
        assert [r.value for r in mine if r.metric_name == "train:loss_scale"] == [
            32768.0, 16384.0, 8192.0]
    assert TrainingJobAnalytics(job).table().to_rows() == table.to_rows()
    assert {m["MetricName"]: m["Value"] for m in job.describe()["FinalMetricDataList"]} == {
        "train:loss": 1.25, "train:loss_scale": 8192.0}


def test_metrics_module_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, fp16_sdk.metrics; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
