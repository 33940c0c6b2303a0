"""The distribution schema: defaults, aliases, cross-field rules and error messages (pure CPU)."""

import json
import subprocess
import sys

import pytest

from fp16_sdk.config import DistributionConfig, SMPParameters, parse_mp_parameters
from fp16_sdk.errors import ConfigError
from helpers.smp_configs import AWS_GPT2_INIT

# Every key and default of the smp table (smp-v1-api.md §2), written from the spec.
SPEC_DEFAULTS = {
    "pipeline_parallel_degree": 1, "microbatches": 1, "pipeline": "interleaved",
    "optimize": "memory", "placement_strategy": "cluster", "auto_partition": True,
    "default_partition": 0, "memory_weight": 0.8, "ddp": False, "active_microbatches": 3,
    "deterministic_server": False, "offload_activations": False,
    "activation_loading_horizon": 4, "tensor_parallel_degree": 1, "fp16": False, "bf16": False,
    "fp16_params": False, "shard_optimizer_state": False, "prescaled_batch": False,
    "skip_tracing": False, "delayed_parameter_initialization": False,
    "sharded_data_parallel_degree": 1, "ddp_dist_backend": "auto", "horovod": False,
    "contiguous": True,
    # keys of the v1.11+ table and of AWS's example scripts (smp_init dicts)
    "static_mode": False, "fast_mode": False, "match_weights": False,
    "sdp_reduce_bucket_size": int(5e8), "sdp_param_persistence_threshold": int(1e6),
    "sdp_max_live_parameters": int(1e9), "sdp_hierarchical_allgather": True,
    "sdp_gradient_clipping": 1.0,
}


def smp(params, mpi=None):
    d = {"smdistributed": {"modelparallel": {"enabled": True, "parameters": params}}}
    if mpi is not None:
        d["mpi"] = mpi
    return d


def test_every_key_has_its_spec_default():
    p = parse_mp_parameters(None)
    assert p.model_dump() == SPEC_DEFAULTS


def test_resolved_defaults_follow_other_keys():
    assert parse_mp_parameters({"optimize": "speed"}).memory_weight == 0.2
    assert parse_mp_parameters({"partitions": 4}).active_microbatches == 6
    assert parse_mp_parameters({"partitions": 4, "active_microbatches": 2}).active_microbatches == 2


def test_partitions_is_an_alias():
    p = parse_mp_parameters({"partitions": 2})
    assert p.pipeline_parallel_degree == 2 and p.partitions == 2


def test_environment_wins_over_init_dict():
    p = parse_mp_parameters(json.dumps({"microbatches": 4}), {"microbatches": 2, "fp16": True})
    assert (p.microbatches, p.fp16) == (4, True)


def test_parameters_from_a_json_file(tmp_path):
    f = tmp_path / "smp.json"
    f.write_text(json.dumps({"microbatches": 8, "partitions": 2}))
    cfg = DistributionConfig.parse(smp(str(f)))
    assert cfg.smp.microbatches == 8 and cfg.smp.pipeline_parallel_degree == 2


def test_hyperparameters_carry_mp_parameters_and_mpi_keys():
    cfg = DistributionConfig.parse(
        smp({"partitions": 2, "microbatches": 4, "fp16": True},
            {"enabled": True, "processes_per_host": 2, "custom_mpi_options": "-x A=1"}),
        instance_count=2, instance_type="ml.p4d.24xlarge")
    assert cfg.hyperparameters() == {
        "sagemaker_mpi_enabled": True, "sagemaker_mpi_num_of_processes_per_host": 2,
        "sagemaker_mpi_custom_mpi_options": "-x A=1",
        "mp_parameters": {"partitions": 2, "microbatches": 4, "fp16": True},  # as written
        # SageMaker's SDK sends the smddp flag with any smdistributed block
        "sagemaker_distributed_dataparallel_enabled": False,
        "sagemaker_instance_type": "ml.p4d.24xlarge"}


def test_no_distribution_adds_nothing():
    assert DistributionConfig.parse(None).hyperparameters() == {}


@pytest.mark.parametrize("dist, key", [
    (smp({"tensor_parallel_degree": 2}), "ddp"),
    (smp({"fp16": True, "bf16": True}), "bf16"),
    (smp({"partitions": 2, "default_partition": 2}), "default_partition"),
    (smp({"partitions": 2, "auto_partition": False}), "default_partition"),
    (smp({"placement_strategy": "DDT"}), "placement_strategy"),
    (smp({"memory_weight": 1.5}), "memory_weight"),
    (smp({"memory_weight": -0.1}), "memory_weight"),
    (smp({"ddp": True, "horovod": True}), "horovod"),
    (smp({"microbatches": 0}), "microbatches"),
    (smp({"partitions": 0}), "partitions"),
    (smp({"active_microbatches": 0}), "active_microbatches"),
    (smp({"pipeline": "gpipe"}), "pipeline"),
    (smp({"optimize": "fast"}), "optimize"),
    (smp({"ddp_dist_backend": "mpi"}), "ddp_dist_backend"),
    (smp({"microbatchs": 2}), "microbatchs"),
    (smp({"fp16": "yes please"}), "fp16"),
    (smp({"partitions": 2, "tensor_parallel_degree": 2, "ddp": True},
         {"enabled": True, "processes_per_host": 3}), "processes_per_host"),
    ({"mpi": {"enabled": True, "processes_per_host": 0}}, "processes_per_host"),
    ({"mpi": {"enabled": True, "custom_mpi_option": "-x A"}}, "custom_mpi_option"),
    ({"smdistributed": {"dataparallel": {"enabled": True, "enable": True}}}, "enable"),
    ({"mpii": {"enabled": True}}, "mpii"),
])
def test_bad_distribution_names_the_key(dist, key):
    with pytest.raises(ConfigError) as err:
        DistributionConfig.parse(dist, instance_count=1)
    assert key in str(err.value)


def test_unknown_key_suggests_the_close_one():
    with pytest.raises(ConfigError, match="did you mean 'microbatches'"):
        parse_mp_parameters({"microbatch": 2})


def test_world_size_rule_shows_the_arithmetic():
    p = SMPParameters(partitions=2, tensor_parallel_degree=2, ddp=True)
    p.check_world_size(8)
    with pytest.raises(ConfigError, match=r"2 \* 2 = 4"):
        p.check_world_size(6)


def test_config_imports_no_torch():
    code = "import fp16_sdk.config, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("given, key", [
    ({"partitions": 2, "microbatches": 2}, "partitions"),
    ({"pipeline_parallel_degree": 2}, "pipeline_parallel_degree"),
])
def test_mp_parameters_keep_the_users_name_for_the_pipeline_degree(given, key):
    """Hugging Face's Trainer reads "partitions" from SM_HP_MP_PARAMETERS: keep the user's key."""
    from fp16_sdk.config import SMPParameters, parse_mp_parameters
    hp = SMPParameters.model_validate(given).to_hyperparameter()
    assert list(hp) == list(given) and hp[key] == 2
    assert parse_mp_parameters(hp).pipeline_parallel_degree == 2


# ---- keys AWS's example scripts pass (issue 12) --------------------------------------------

def test_aws_example_init_dict_is_accepted_as_written():
    p = parse_mp_parameters(None, AWS_GPT2_INIT)
    assert {k: getattr(p, k) for k in AWS_GPT2_INIT} == AWS_GPT2_INIT
    old_gptj = {"ddp": True, "pipeline_parallel_degree": 2, "microbatches": 4,
                "_match_weights": True, "static_mode": True, "fast_mode": True}
    q = parse_mp_parameters(old_gptj)
    assert (q.match_weights, q.static_mode, q.fast_mode) == (True, True, True)


def test_sdp_keys_keep_their_documented_types():
    p = parse_mp_parameters({"sdp_reduce_bucket_size": int(2e8), "sdp_max_live_parameters": 5e8,
                             "sdp_param_persistence_threshold": 0, "sdp_gradient_clipping": 0.5})
    assert p.sdp_max_live_parameters == 500_000_000 and isinstance(p.sdp_max_live_parameters, int)
    assert (p.sdp_reduce_bucket_size, p.sdp_param_persistence_threshold) == (200_000_000, 0)
    assert p.sdp_gradient_clipping == 0.5
    with pytest.raises(ConfigError, match="sdp_gradient_clipping"):
        parse_mp_parameters({"sdp_gradient_clipping": -1.0})
    with pytest.raises(ConfigError, match="sdp_reduce_bucket_size"):
        parse_mp_parameters({"sdp_reduce_bucket_size": 0})


@pytest.mark.parametrize("params, key, fix", [
    ({"sharded_data_parallel_degree": 2, "ddp": True, "pipeline_parallel_degree": 2},
     "sharded_data_parallel_degree=2", "needs pipeline_parallel_degree=1"),
    ({"sharded_data_parallel_degree": 2, "ddp": True, "shard_optimizer_state": True},
     "sharded_data_parallel_degree=2", "remove \"shard_optimizer_state\""),
])
def test_unsupported_combinations_are_refused_before_anything_starts(params, key, fix):
    with pytest.raises(ConfigError) as err:
        DistributionConfig.parse(smp(params))  # the estimator's check, before any job
    assert key in str(err.value) and fix in str(err.value)
    with pytest.raises(ConfigError):
        parse_mp_parameters(params)  # and smp.init()'s


def test_offload_activations_is_accepted_with_its_horizon():
    p = parse_mp_parameters({"offload_activations": True, "activation_loading_horizon": 2})
    assert p.offload_activations and p.activation_loading_horizon == 2
    with pytest.raises(ConfigError, match="activation_loading_horizon"):
        parse_mp_parameters({"offload_activations": True, "activation_loading_horizon": 0})


@pytest.mark.parametrize("typo, hint", [("static_mod", "static_mode"), ("fastmode", "fast_mode"),
                                        ("sdp_gradient_clip", "sdp_gradient_clipping")])
def test_new_keys_have_closest_key_hints(typo, hint):
    with pytest.raises(ConfigError, match=f"did you mean '{hint}'"):
        parse_mp_parameters({typo: True})


def test_match_weights_reaches_the_job_under_smps_name():
    cfg = DistributionConfig.parse(smp({"partitions": 2, "_match_weights": True}))
    assert cfg.hyperparameters()["mp_parameters"] == {"partitions": 2, "_match_weights": True}
