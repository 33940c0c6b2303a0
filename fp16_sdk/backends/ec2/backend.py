"""Training jobs on plain EC2 instances: same image, same /opt/ml contract, no SageMaker.

Selected by passing `fp16_sdk.session.EC2Session(...)` as the estimator's `sagemaker_session`.
`plan` decides everything an instance needs under `<job root>/ec2/` in S3 (the job root is
where the code goes: `s3://<bucket>/<code_location prefix>/<job>/`); `start` writes it,
launches one instance per host with `RunInstances` (user data rendered from `userdata.sh`), then publishes the hosts'
private addresses (`hosts.json`). The handle waits on `ec2/status/<host>.json`, streams
`ec2/logs/<host>.log`, and terminates every instance on stop(), failure or timeout.

S3 layout of a job (next to `source/sourcedir.tar.gz`):
    ec2/config/algo-N/{hyperparameters,resourceconfig,inputdataconfig}.json, env.tsv, manifest.tsv
    ec2/hosts.json, ec2/hosts.txt, ec2/job.json, ec2/logs/algo-N.log, ec2/status/algo-N.json
Artifacts land where SageMaker puts them: `<output_path>/<job>/output/{model,output}.tar.gz`.
"""

from __future__ import annotations

import base64
import importlib.resources
import json
import os
import re
import shlex
import time
from typing import Any, Mapping, TextIO

from fp16_sdk import contract
from fp16_sdk.backends.base import BACKENDS, Backend, JobSpec, Plan, refuse_unknown_options
from fp16_sdk.backends.ec2.job import EC2Job
from fp16_sdk.backends.placement import S3_STORAGE
from fp16_sdk.backends.rules import check_remote_request
from fp16_sdk.errors import BackendError, ConfigError
from fp16_sdk.extraction import relative_parts
from fp16_sdk.session import EC2Session, parse_s3_uri

__all__ = ["EC2Backend", "render_user_data", "host_configs", "channel_manifest", "env_table"]

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # fullmatch: `$` accepts a final "\n"
_SETTINGS_LINE = "# @@FP16_SDK_SETTINGS@@"
USER_DATA_LIMIT = 16384  # EC2's limit on raw user data, in bytes


def render_user_data(settings: dict[str, str]) -> str:
    """The instance script: the template with `settings` as shell-quoted assignments."""
    template = importlib.resources.files(__package__).joinpath("userdata.sh").read_text()
    lines = []
    for name, value in settings.items():
        assert _ENV_NAME.fullmatch(name), name
        lines.append(f"{name}={shlex.quote(str(value))}")
    return template.replace(_SETTINGS_LINE, "\n".join(lines), 1)


def host_configs(spec: JobSpec, *, region: str,
                 submit_uri: str | None = None) -> dict[str, dict[str, str]]:
    """Per host: the /opt/ml/input/config files, as the text SageMaker would write (pure).

    `submit_uri`: the code's URI when `spec` does not carry it yet; `region` completes a
    request whose hyperparameters have no sagemaker_region (a hand-built spec)."""
    if submit_uri is not None:
        spec = spec.with_code_uri(submit_uri)
    hyperparameters = {**contract.encode_hyperparameters({"sagemaker_region": region}),
                       **spec.hyperparameters}
    channels = contract.input_data_config(spec.channels, input_mode=spec.input_mode)
    return {host: contract.config_files(
        hyperparameters=hyperparameters, input_data_config=channels,
        # the instance script swaps eth0 for the real interface (exact text)
        resource_config=contract.resource_config(
            current_host=host, hosts=spec.hosts, instance_type=spec.instance_type,
            network_interface_name="eth0")) for host in spec.hosts}


def channel_manifest(spec: JobSpec, s3_client: Any) -> dict[str, str]:
    """Per host: `channel<TAB>s3 uri<TAB>relative path` lines of the objects it downloads.

    FullyReplicated gives every host every object under the prefix; ShardedByS3Key gives host
    i (0-based) the objects whose index in key order is i mod instance_count, as SageMaker does.
    """
    lines: dict[str, list[str]] = {host: [] for host in spec.hosts}
    for channel in spec.channels:
        bucket, prefix = parse_s3_uri(channel.uri)
        keys = []
        for page in s3_client.get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                        Prefix=prefix):
            keys += [o["Key"] for o in page.get("Contents", []) if not o["Key"].endswith("/")]
        if not keys:
            raise ConfigError(f"input channel {channel.name!r}: no objects under {channel.uri}",
                              key=f"inputs[{channel.name}]", value=channel.uri)
        # A prefix names a folder when keys lie under "<prefix>/" (SageMaker puts them relative
        # to it, however deep the prefix); a partial name ("data/tr") keeps the matched part.
        folder = prefix if prefix.endswith("/") or not prefix else prefix + "/"
        parent = prefix[:prefix.rfind("/") + 1]
        for index, key in enumerate(sorted(keys)):
            rel = key[len(folder):] if key.startswith(folder) else key[len(parent):]
            if "\t" in key or "\n" in key:
                raise ConfigError(f"S3 key {key!r} has a tab or newline", key="inputs", value=key)
            try:  # the same containment rule as code extraction: the file stays in its channel
                rel = "/".join(relative_parts(rel))
            except ValueError as exc:
                raise ConfigError(f"input channel {channel.name!r}: S3 key {key!r} {exc}; it "
                                  "cannot be placed under /opt/ml/input/data, rename the "
                                  "object", key=f"inputs[{channel.name}]", value=key) from None
            if not rel:
                raise ConfigError(f"input channel {channel.name!r}: S3 key {key!r} names no "
                                  "file inside the channel; rename the object",
                                  key=f"inputs[{channel.name}]", value=key)
            targets = (spec.hosts if channel.distribution == "FullyReplicated"
                       else [spec.hosts[index % spec.instance_count]])
            for host in targets:
                lines[host].append(f"{channel.name}\ts3://{bucket}/{key}\t{rel}")
    return {host: "".join(line + "\n" for line in rows) for host, rows in lines.items()}


def env_table(spec: JobSpec) -> str:
    """env.tsv: one `NAME<TAB>base64(value)` line per variable of the job's environment.

    Data, not shell code: the instance script passes these to the training process only
    (`env NAME=value` / `docker run -e NAME=value`), never into its own variables, so a key
    such as IMAGE or OUTPUT_URI cannot redirect the job.
    """
    for name in spec.environment:
        if not _ENV_NAME.fullmatch(name):
            raise ConfigError(f"environment variable name {name!r} is not a valid shell name",
                              key="environment", value=name)
    return "".join(f"{name}\t{base64.b64encode(str(value).encode()).decode()}\n"
                   for name, value in spec.environment.items())


class EC2Backend(Backend):
    """Runs each host of a job on its own EC2 instance.

    Args:
        session: the `EC2Session` carrying the AMI, instance profile, network and image.
        out: where status and log lines are printed.
    """

    NAME = "EC2"
    OPTIONS = {"pull_policy": "'always' (default): docker pull the image on every instance; "
                              "'missing': pull only when the AMI does not hold it already"}
    _PULL_POLICIES = ("always", "missing")

    def __init__(self, session: EC2Session, *, out: TextIO | None = None):
        if not isinstance(session, EC2Session):
            raise ConfigError("EC2Backend needs an EC2Session (fp16_sdk.session.EC2Session)",
                              key="sagemaker_session", value=type(session).__name__)
        self.session = session
        self.out = out

    @classmethod
    def from_choice(cls, *, instance_type: str | None, session: Any) -> "EC2Backend":
        return cls(session)

    @classmethod
    def parse_options(cls, options: Mapping[str, Any]) -> str:
        """The pull policy ("always" unless backend_options says "missing")."""
        refuse_unknown_options(cls.NAME, options, cls.OPTIONS)
        policy = options.get("pull_policy", "always")
        if policy not in cls._PULL_POLICIES:
            raise ConfigError(f"backend_options['pull_policy']={policy!r} must be one of "
                              f"{', '.join(cls._PULL_POLICIES)}", key="pull_policy", value=policy)
        return policy

    def plan(self, spec: JobSpec) -> Plan:
        """The checks, the completed request (image, code URI) and every file the instances
        read (per host: config files, env.tsv, manifest.tsv); nothing is uploaded or launched.

        Raises:
            ConfigError: a setting EC2 cannot honour, or an input the instances cannot read.
        """
        spec = spec.completed(image_uri=spec.image_uri or self.session.ec2.image_uri)
        check_remote_request(spec, BACKENDS["ec2"])
        _check_ec2_spec(spec)
        options = self.options_of(spec)
        region = self.session.boto_region_name
        spec = spec.with_code_uri(S3_STORAGE.code_uri(spec, self.session))
        job_uri = spec.code_uri.rsplit("/source/", 1)[0]
        output_root = (spec.output_path if spec.output_path and spec.output_path.startswith("s3://")
                       else f"s3://{self.session.default_bucket()}/")
        manifests = channel_manifest(spec, self.session.client("s3"))
        env = env_table(spec)
        uploads = {f"{job_uri}/ec2/config/{host}/{name}": text
                   for host, files in host_configs(spec, region=region).items()
                   for name, text in {**files, "env.tsv": env,
                                      "manifest.tsv": manifests[host]}.items()}
        return Plan(spec, options, steps=(
            f"upload {spec.sourcedir} to {spec.code_uri}",
            *(f"upload {uri}" for uri in uploads),
            f"RunInstances x{spec.instance_count} ({spec.instance_type.removeprefix('ml.')})",
            f"upload {job_uri}/ec2/hosts.json, hosts.txt, job.json"),
            detail={"job_uri": job_uri, "region": region, "uploads": uploads,
                    "output_uri": f"{output_root.rstrip('/')}/{spec.job_name}"})

    def start(self, plan: Plan) -> EC2Job:
        """Write the job's files to S3, launch the instances, publish their addresses.

        Raises:
            BackendError: EC2 refused to launch (instances already started are terminated).
        """
        spec, job_uri = plan.spec, plan.detail["job_uri"]
        output_uri, region = plan.detail["output_uri"], plan.detail["region"]
        self.session.upload_file(spec.sourcedir, spec.code_uri)
        for uri, text in plan.detail["uploads"].items():
            self.session.upload_bytes(text.encode(), uri)
        instances = self._launch_all(spec, job_uri=job_uri, output_uri=output_uri, region=region,
                                     pull_policy=plan.options)
        try:  # until the job record exists, nothing else knows these instances: never leak them
            addresses = {host: inst["PrivateIpAddress"] for host, inst in instances.items()}
            self.session.upload_bytes(json.dumps(addresses).encode(), f"{job_uri}/ec2/hosts.json")
            hosts_txt = "".join(f"{ip} {host}\n" for host, ip in addresses.items())
            self.session.upload_bytes(hosts_txt.encode(), f"{job_uri}/ec2/hosts.txt")
            record = {"job_name": spec.job_name, "job_uri": job_uri, "output_uri": output_uri,
                      "instance_type": spec.instance_type, "volume_size": spec.volume_size,
                      "max_run": spec.max_run, "submitted": time.time(),
                      "instances": {h: {"InstanceId": i["InstanceId"],
                                        "PrivateIpAddress": i["PrivateIpAddress"]}
                                    for h, i in instances.items()}}
            self.session.upload_bytes(json.dumps(record, indent=1).encode(),
                                      f"{job_uri}/ec2/job.json")
        except BaseException:
            self.session.client("ec2").terminate_instances(
                InstanceIds=[i["InstanceId"] for i in instances.values()])
            raise
        return EC2Job(self.session, record, out=self.out)

    def attach(self, job_uri: str) -> EC2Job:
        """A handle on a job from its S3 root (`s3://bucket/[prefix/]<job>`).

        Raises:
            BackendError: no EC2 job record under that root.
        """
        raw = self.session.read_bytes(f"{job_uri.rstrip('/')}/ec2/job.json")
        if raw is None:
            raise BackendError(f"no EC2 job under {job_uri} (expected {job_uri}/ec2/job.json)")
        return EC2Job(self.session, json.loads(raw), out=self.out)

    def _launch_all(self, spec: JobSpec, *, job_uri: str, output_uri: str, region: str,
                    pull_policy: str) -> dict[str, dict]:
        ec2 = self.session.client("ec2")
        root_device = self._root_device(ec2)
        launched: dict[str, dict] = {}
        try:
            for host in spec.hosts:
                script = render_user_data(self._script_settings(
                    spec, host=host, job_uri=job_uri, output_uri=output_uri, region=region,
                    pull_policy=pull_policy))
                if len(script.encode()) > USER_DATA_LIMIT:
                    raise BackendError(f"the instance script is {len(script.encode())} bytes; "
                                       f"EC2 accepts at most {USER_DATA_LIMIT}")
                request = self._run_request(spec, host=host, script=script,
                                            root_device=root_device)
                launched[host] = ec2.run_instances(**request)["Instances"][0]
            return self._with_addresses(ec2, launched)
        except BaseException as err:  # Ctrl-C between two RunInstances too: none is leaked
            if launched:
                ec2.terminate_instances(InstanceIds=[i["InstanceId"] for i in launched.values()])
            if isinstance(err, (BackendError, ConfigError)) or not isinstance(err, Exception):
                raise
            message = getattr(err, "response", {}).get("Error", {}).get("Message", str(err))
            raise BackendError(f"RunInstances for {spec.job_name} failed: {message}") from err

    def _root_device(self, ec2: Any) -> str | None:
        images = ec2.describe_images(ImageIds=[self.session.ec2.ami_id])["Images"]
        if not images:
            raise ConfigError(f"ami_id {self.session.ec2.ami_id} does not exist in "
                              f"{self.session.boto_region_name}", key="ami_id",
                              value=self.session.ec2.ami_id)
        return images[0].get("RootDeviceName")

    def _script_settings(self, spec: JobSpec, *, host: str, job_uri: str, output_uri: str,
                         region: str, pull_policy: str) -> dict[str, str]:
        settings = {"JOB_NAME": spec.job_name, "CURRENT_HOST": host, "JOB_URI": job_uri,
                    "OUTPUT_URI": output_uri, "IMAGE": spec.image_uri, "REGION": region,
                    "MAX_RUN": str(spec.max_run), "PULL_POLICY": pull_policy}
        if self.session.ec2.forward_endpoints:
            for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL_ECR"):
                if os.environ.get(name):
                    settings[name] = os.environ[name]
        return settings

    def _run_request(self, spec: JobSpec, *, host: str, script: str,
                     root_device: str | None) -> dict:
        s = self.session.ec2
        tags = [{"Key": "Name", "Value": f"{spec.job_name}-{host}"},
                {"Key": "fp16-sdk:job-name", "Value": spec.job_name},
                {"Key": "fp16-sdk:host", "Value": host}]
        tags += [{"Key": t["Key"], "Value": t["Value"]} for t in spec.tags]
        request: dict[str, Any] = {
            "ImageId": s.ami_id, "InstanceType": spec.instance_type.removeprefix("ml."),
            "MinCount": 1, "MaxCount": 1, "UserData": script,
            "InstanceInitiatedShutdownBehavior": "terminate",
            "TagSpecifications": [{"ResourceType": "instance", "Tags": tags},
                                  {"ResourceType": "volume", "Tags": tags}],
            # IMDSv2 with hop limit 2 so the container (host network) gets the role's credentials
            "MetadataOptions": {"HttpTokens": "required", "HttpPutResponseHopLimit": 2,
                                "HttpEndpoint": "enabled"},
        }
        if root_device:
            request["BlockDeviceMappings"] = [{"DeviceName": root_device, "Ebs": {
                "VolumeSize": spec.volume_size, "VolumeType": "gp3",
                "DeleteOnTermination": True}}]
        if s.instance_profile:
            key = "Arn" if s.instance_profile.startswith("arn:") else "Name"
            request["IamInstanceProfile"] = {key: s.instance_profile}
        subnet = s.subnet_id or (spec.subnets[0] if spec.subnets else None)
        if subnet:
            request["SubnetId"] = subnet
        groups = s.security_group_ids or tuple(spec.security_group_ids or ())
        if groups:
            request["SecurityGroupIds"] = list(groups)
        if s.key_name:
            request["KeyName"] = s.key_name
        if spec.use_spot_instances:
            request["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": {
                "SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}}
        return request

    def _with_addresses(self, ec2: Any, launched: dict[str, dict]) -> dict[str, dict]:
        """Wait (briefly) until every instance has a private address."""
        deadline = time.monotonic() + 300
        while True:
            missing = [i["InstanceId"] for i in launched.values() if not i.get("PrivateIpAddress")]
            if not missing:
                return launched
            if time.monotonic() > deadline:
                raise BackendError(f"instances {missing} got no private address within 300 s")
            time.sleep(2)
            found = {i["InstanceId"]: i for r in ec2.describe_instances(InstanceIds=missing)
                     ["Reservations"] for i in r["Instances"]}
            for host, inst in launched.items():
                if inst["InstanceId"] in found:
                    launched[host] = found[inst["InstanceId"]]


def _check_ec2_spec(spec: JobSpec) -> None:
    unsupported = {"enable_network_isolation": spec.enable_network_isolation,
                   "keep_alive_period_in_seconds": spec.keep_alive_period_in_seconds}
    for key, value in unsupported.items():
        if value:
            raise ConfigError(f"{key}={value!r} is a SageMaker feature that EC2 jobs do not have; "
                              "drop it or run on SageMaker (a plain Session)", key=key, value=value)
    for channel in spec.channels:
        if channel.s3_data_type != "S3Prefix" or (channel.input_mode or spec.input_mode) != "File":
            raise ConfigError(f"input channel {channel.name!r}: EC2 jobs support S3Prefix data in "
                              f"File mode (got {channel.s3_data_type}, "
                              f"{channel.input_mode or spec.input_mode})",
                              key=f"inputs[{channel.name}]", value=channel.uri)
    if spec.checkpoint_s3_uri:
        raise ConfigError("checkpoint_s3_uri is not synced on EC2 jobs yet: save checkpoints "
                          "to S3 from the script, or run on SageMaker", key="checkpoint_s3_uri",
                          value=spec.checkpoint_s3_uri)
