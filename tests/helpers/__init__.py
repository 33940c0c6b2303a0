"""Shared test machinery, one module per concern (import the module you need; this package
imports nothing, so an SDK test that must not import torch can use `helpers.ports`).

- `paths`: `REPO`, `TESTS`, `SCRIPTS`: the repository root, tests/ and tests/scripts/ (a test in
  a tier folder never counts parents).
- `ports`: `free_port()`, a TCP port free a moment ago.
- `mp`: `run_ranks(fn, world, *args)`, a function on N real Gloo processes (imports torch).
- `procs`: the live processes as /proc shows them (`scan`, `with_env`, `kill_all`), for the
  leak checks of conftest.py and the process-lifetime tests.
- `aws`: the AWS API emulator (moto's server) fixtures `moto_server` / `aws`, and
  `capture_requests` (request bodies as botocore sends them) and `make_buckets`.
- `smp_configs`: smp configuration dicts from AWS's example scripts (`AWS_GPT2_INIT`).
- `tp_checks`: `assert_close` and `full_grads` (gathered to the unsplit layout) for TP tests.
- `tiny_gpt`: `TinyGPT`, `batches`, `lm_loss`: the small transformer and the data the optimizer
  tests (fp16, sharded optimizer state, sharded data parallelism) train (imports torch).
- `smp_one_process`: the smp runtime in this process at world 1 (`start` fixture, `DEVICES`,
  `train_step` of TinyGPT) for the fp16 optimizer tests (imports torch).
- `toolkit_jobs`: a fake /opt/ml tree with packed code (`make_job`) and the toolkit's
  environment (`toolkit_env`) / a run of the real toolkit (`run_toolkit`).
- `models`: the test models' building blocks (`ResidualTanh`, `ObservedBlock` / `ObservedNet`,
  `ResidualMLP`, `GPTBlock`, `AutoTPBlock`), one class per kind of block (imports torch).
- `tiny_lm`: `TinyLM` (embedding, residual blocks, tied head) for the pipeline tests.
- `lm_head`: smp.nn's DistributedTransformerLMHead at CPU size (`LM`), its batches, this
  rank's rows and the single-process reference step, for the pp x tp tests.
- `pipeline_data`: a tiny Hugging Face GPT-2 (`tiny_gpt2`) and the pp=2 tests' batches.
- `files`: `load_module(path)`, a script or tool file loaded as a module.
- `cross_entropy`: `fp32_cross_entropy`, the fp32 reference of the fused cross-entropy tests
  (unit and gpu tiers; imports torch).
- `slurm_cluster`: the real Slurm cluster in containers (.ci/slurm-cluster.sh), the session
  fixture `slurm_cluster` -> `SlurmCluster` (controller, nodes, shared folder, submit commands).
- `live_bytes`: `LiveBytes`, the peak CPU storage bytes alive at once (delayed-init tests).
- `docker_engine`: the real Docker engine (`client` fixture; skips, or fails with CI=true, without
  it), the test image name `IMAGE` and `estimator`, a local Docker job's estimator.
- `docker_jobs`: `job_name()` (a fresh local Docker job name) and `leftovers(client, job)` (what
  of a job the engine still holds), for the local Docker tests.
- `ec2_stand_ins`: the EC2 backend's emulated account (`infra`) and training-image containers
  standing in for instances (`run_stand_ins`).
- `hf_versions`: `hf_folder`, the extra transformers versions (oldest, newest) jobs run on.
- `forged_numpy`: numpy pickles forged as an attacker would (`object_array_from` an address,
  `flagged_float_array`), for the checkpoint loader's tests (imports torch).
- `forged_failure`: a script forging its failure file's header (`FORGER`), `fit_outcome` (fails
  when fit() hangs) and `check_forged_failure`, for local_process and Docker.
- `forked_sdk`: `run_driver`, an SDK that starts a job with wait=False and forks a child that
  exits normally, for local_process and Docker.
- `import_graph`: `import_graph()` (fp16_sdk module -> the fp16_sdk modules it imports, read
  with ast, type-only imports included) and `cycles(graph)`, for the import tests.

No test module imports another (tests/unit/test_import_boundaries.py checks it): what two test
files share lives here. This list names every module of the package, and only those
(tests/unit/test_helpers_map.py checks it).
"""
