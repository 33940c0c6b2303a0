"""`TrainingInput`: one input channel, shaped like `sagemaker.inputs.TrainingInput`.

The estimator turns every channel (a URI string or a `TrainingInput`) into a
`backends.base.Channel`; values are checked here, where the user made them, and the URI by the
chosen backend row's placement policy (`Placement.check_channel`).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from fp16_sdk.backends.base import Channel
from fp16_sdk.errors import ConfigError

if TYPE_CHECKING:
    from fp16_sdk.backends.placement import Placement

__all__ = ["TrainingInput", "channels_from_inputs", "DISTRIBUTIONS", "S3_DATA_TYPES", "INPUT_MODES",
           "data_source_config"]

DISTRIBUTIONS = ("FullyReplicated", "ShardedByS3Key")
S3_DATA_TYPES = ("S3Prefix", "ManifestFile", "AugmentedManifestFile")
INPUT_MODES = ("File", "Pipe", "FastFile")
COMPRESSIONS = (None, "None", "Gzip")
RECORD_WRAPPINGS = (None, "None", "RecordIO")


def _check_choice(key: str, value, choices) -> None:
    if value not in choices:
        shown = ", ".join(repr(c) for c in choices)
        raise ConfigError(f"TrainingInput {key}={value!r} is not valid: use one of {shown}",
                          key=key, value=value)


class TrainingInput:
    """An input channel's data source and how the container receives it.

    Args:
        s3_data: the channel's URI: `s3://bucket/prefix` (SageMaker) or `file:///abs/path`
            (local modes).
        distribution: "FullyReplicated" (every host gets all data) or "ShardedByS3Key".
        compression: None or "Gzip".
        content_type: MIME type passed to the container as ContentType.
        record_wrapping: None or "RecordIO".
        s3_data_type: "S3Prefix", "ManifestFile" or "AugmentedManifestFile".
        input_mode: per-channel override of the estimator's input_mode ("File", "Pipe",
            "FastFile"); None keeps the estimator's.

    Raises:
        ConfigError: a value outside SageMaker's allowed set, or a URI that is neither s3://
            nor file://.
    """

    def __init__(self, s3_data: str, distribution: str = "FullyReplicated",
                 compression: str | None = None, content_type: str | None = None,
                 record_wrapping: str | None = None, s3_data_type: str = "S3Prefix",
                 input_mode: str | None = None):
        if not isinstance(s3_data, str) or not s3_data.startswith(("s3://", "file://")):
            raise ConfigError(
                f"TrainingInput s3_data={s3_data!r} must be an s3:// or file:// URI "
                "(e.g. 's3://bucket/train' or 'file:///data/train')", key="s3_data", value=s3_data)
        distribution = distribution or "FullyReplicated"  # SageMaker treats None as the default
        _check_choice("distribution", distribution, DISTRIBUTIONS)
        _check_choice("compression", compression, COMPRESSIONS)
        _check_choice("record_wrapping", record_wrapping, RECORD_WRAPPINGS)
        _check_choice("s3_data_type", s3_data_type, S3_DATA_TYPES)
        _check_choice("input_mode", input_mode, (None, *INPUT_MODES))
        if content_type is not None and not isinstance(content_type, str):
            raise ConfigError(f"TrainingInput content_type={content_type!r} must be a string "
                              "such as 'text/csv'", key="content_type", value=content_type)
        self.s3_data = s3_data
        self.distribution = distribution
        self.compression = None if compression == "None" else compression
        self.content_type = content_type
        self.record_wrapping = None if record_wrapping == "None" else record_wrapping
        self.s3_data_type = s3_data_type
        self.input_mode = input_mode

    @property
    def config(self) -> dict:
        """The channel as CreateTrainingJob's InputDataConfig entry (without ChannelName)."""
        return data_source_config(self.s3_data, s3_data_type=self.s3_data_type,
                                  distribution=self.distribution, compression=self.compression,
                                  content_type=self.content_type,
                                  record_wrapping=self.record_wrapping,
                                  input_mode=self.input_mode)

    def __repr__(self) -> str:
        return f"TrainingInput({self.s3_data!r}, distribution={self.distribution!r})"


# CreateTrainingJob's ChannelName pattern.
_CHANNEL_NAME = re.compile(r"[A-Za-z0-9.\-_]{1,64}")  # fullmatch: `$` accepts a final "\n"


def channels_from_inputs(inputs, *, placement: "Placement",
                         instance_type: str) -> tuple[Channel, ...]:
    """Turn fit()'s `inputs` into validated channels.

    Args:
        inputs: None; a URI string (channel "training"); a `TrainingInput` (channel
            "training"); or a dict channel name -> URI string or `TrainingInput`.
        placement: the chosen backend row's placement policy: which URIs it reads
            (`Placement.check_channel`: file:// on this machine or a shared filesystem, s3://).
        instance_type: the job's instance type, as errors name it.

    Returns:
        The channels in the order given.

    Raises:
        ConfigError: bad shape, bad channel name, two names that map to the same
            SM_CHANNEL_<NAME> variable, a URI the placement cannot read, a missing path.
    """
    if inputs is None:
        return ()
    if isinstance(inputs, (str, TrainingInput)):
        inputs = {"training": inputs}
    if not isinstance(inputs, dict):
        raise ConfigError(
            f"inputs={inputs!r} must be a URI string, a TrainingInput, or a dict of channel "
            "name -> URI/TrainingInput", key="inputs", value=inputs)
    channels, seen = [], {}
    for name, source in inputs.items():
        if not isinstance(name, str) or not _CHANNEL_NAME.fullmatch(name) or \
                name in (".", ".."):  # a channel is a folder under /opt/ml/input/data
            raise ConfigError(
                f"inputs channel name {name!r} is not valid: use 1-64 characters of "
                "letters, digits, '.', '-' or '_' (not '.' or '..')", key="inputs",
                value=name)
        env_name = name.upper()  # the container exposes it as SM_CHANNEL_<NAME>
        if env_name in seen:
            raise ConfigError(
                f"inputs channels {seen[env_name]!r} and {name!r} are duplicates: both become "
                f"SM_CHANNEL_{env_name}; rename one", key="inputs", value=name)
        seen[env_name] = name
        channel = _channel(name, source)
        placement.check_channel(name, channel.uri, instance_type=instance_type)
        channels.append(channel)
    return tuple(channels)


def _channel(name: str, source) -> Channel:
    if isinstance(source, str):
        source = TrainingInput(source) if source.startswith(("s3://", "file://")) else source
    if not isinstance(source, TrainingInput):
        raise ConfigError(
            f"inputs[{name!r}]={source!r} must be an s3:// or file:// URI or a TrainingInput "
            f"(for a local folder write 'file:///abs/path')", key="inputs", value=source)
    return Channel(name=name, uri=source.s3_data, distribution=source.distribution,
                   content_type=source.content_type, compression=source.compression,
                   record_wrapping=source.record_wrapping, s3_data_type=source.s3_data_type,
                   input_mode=source.input_mode)


def data_source_config(uri: str, *, s3_data_type: str, distribution: str,
                       compression: str | None = None, content_type: str | None = None,
                       record_wrapping: str | None = None,
                       input_mode: str | None = None) -> dict:
    """One InputDataConfig entry of CreateTrainingJob (without ChannelName); optional keys only
    when set."""
    cfg: dict = {"DataSource": {"S3DataSource": {
        "S3DataType": s3_data_type, "S3Uri": uri, "S3DataDistributionType": distribution}}}
    for key, value in (("CompressionType", compression), ("ContentType", content_type),
                       ("RecordWrapperType", record_wrapping), ("InputMode", input_mode)):
        if value:
            cfg[key] = value
    return cfg

