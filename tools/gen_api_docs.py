"""Generate docs/runtime-api.md from the smp runtime (`fp16_sdk.modelparallel.torch`).

Every name in the package's `__all__` gets its signature (read with `inspect`) and one line of
semantics: the first line of its docstring, else the line written here from the spec
(shared spec smp-v1-api.md). Names the spec lists but the runtime does not export yet are listed
under "Not provided yet", so the page never claims more than the code has.

    python3 tools/gen_api_docs.py           # write docs/runtime-api.md
    python3 tools/gen_api_docs.py --check   # exit 1 if the committed page is out of date
"""

from __future__ import annotations

import argparse
import enum
import inspect
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import fp16_sdk.modelparallel.torch as smp  # noqa: E402

OUT = ROOT / "docs" / "runtime-api.md"

GROUPS = [
    ("Setup and ranks", ["init", "is_initialized", "is_tracing", "state", "rank", "size",
                         "local_rank", "local_size", "dp_rank", "dp_size", "tp_rank", "tp_size",
                         "pp_rank", "pp_size", "rdp_rank", "rdp_size", "mp_rank", "mp_size"]),
    ("Process groups and rank lists", [
        "get_world_process_group", "get_mp_process_group", "get_dp_process_group",
        "get_tp_process_group", "get_pp_process_group", "get_rdp_process_group",
        "get_mp_group", "get_dp_group", "get_tp_group", "get_pp_group", "get_rdp_group"]),
    ("Object communication", ["CommGroup", "RankType", "WORLD", "MP_GROUP", "DP_GROUP",
                              "TP_GROUP", "PP_GROUP", "RDP_GROUP", "WORLD_RANK", "MP_RANK",
                              "DP_RANK", "TP_RANK", "PP_RANK", "RDP_RANK", "broadcast", "send",
                              "recv_from", "allgather", "barrier", "dp_barrier", "mp_barrier"]),
    ("Training", ["step", "StepOutput", "DistributedModel", "DistributedOptimizer", "model"]),
    ("Model creation", ["model_creation", "tensor_parallelism", "set_tensor_parallelism",
                        "tp_register", "tp_register_with_module", "partition", "set_partition",
                        "delay_param_initialization", "set_activation_checkpointing"]),
    ("Checkpoints", ["save", "load", "save_checkpoint", "resume_from_checkpoint"]),
    ("Mixed precision, optimizers, utilities", ["amp", "optimizers", "utils"]),
    ("Tensor-parallel modules", ["nn"]),
    ("Errors", ["errors", "SMPError", "SMPConfigError", "SMPNotInitializedError", "StepError",
                "CommError", "CheckpointError", "SMPUnsupportedError"]),
]

# Semantics for names whose docstring is missing (written from the spec, §1, §9).
FALLBACK = {
    "dp_rank": "Rank inside the data-parallel group (the ranks holding this rank's partition).",
    "tp_rank": "Rank inside the tensor-parallel group.",
    "tp_size": "Tensor-parallel degree (`tensor_parallel_degree`).",
    "pp_rank": "Pipeline stage of this rank (0 .. pp_size() - 1).",
    "pp_size": "Pipeline-parallel degree (`pipeline_parallel_degree`).",
    "rdp_rank": "Rank inside the reduced-data-parallel group (same pp and tp ranks).",
    "rdp_size": "size / (pp * tp): the number of model replicas.",
    "mp_rank": "Rank inside the model-parallel group (the ranks of one model replica).",
    "get_world_process_group": "torch ProcessGroup of every rank.",
    "get_mp_process_group": "torch ProcessGroup of this rank's model-parallel group.",
    "get_dp_process_group": "torch ProcessGroup of this rank's data-parallel group.",
    "get_tp_process_group": "torch ProcessGroup of this rank's tensor-parallel group.",
    "get_pp_process_group": "torch ProcessGroup of this rank's pipeline group.",
    "get_rdp_process_group": "torch ProcessGroup of this rank's reduced-data-parallel group.",
    "get_tp_group": "Global ranks of this rank's tensor-parallel group.",
    "get_pp_group": "Global ranks of this rank's pipeline (one per stage).",
    "get_rdp_group": "Global ranks of this rank's reduced-data-parallel group.",
    "save_checkpoint": "Write `{tag}_partial/` (model, optimizer, fp16 state, user content) and "
                       "`newest` under a path.",
    "resume_from_checkpoint": "Load a checkpoint written by save_checkpoint; returns the user "
                              "content, weights applied at the first step.",
}

# Methods without a docstring of their own (an inherited nn.Module docstring would mislead).
METHOD_FALLBACK = {
    "DistributedModel.forward": "Run the model; only inside an @smp.step function.",
    "DistributedModel.local_named_parameters": "(name, parameter) pairs held by this rank.",
    "DistributedModel.local_parameters": "The parameters held by this rank.",
    "DistributedModel.local_named_buffers": "(name, buffer) pairs held by this rank.",
    "DistributedModel.local_buffers": "The buffers held by this rank.",
    "DistributedModel.local_named_modules": "(name, module) pairs placed on this rank's stage.",
    "DistributedModel.local_modules": "The modules placed on this rank's stage.",
    "DistributedModel.is_distributed_buffer": "A tensor-parallel shard of a buffer.",
    "DistributedModel.is_scaled_batch_buffer": "A buffer of a distributed module (it sees the "
                                               "TP group's batch).",
}

# Instance attributes scripts read that `inspect` cannot see on the class.
ATTRIBUTES = {
    "DistributedOptimizer": [
        ("overflow", "bool: whether the last step overflowed (and was skipped)."),
        ("optimizer", "the wrapped torch optimizer (its param_groups hold the fp32 masters in "
                      "fp16 mode; give it to LR schedulers)."),
    ],
}


# How Hugging Face's Trainer meets this runtime (tests/multiprocess/test_hf_trainer.py shows each
# line).
HF_TRAINER = [
    "## Hugging Face Trainer", "",
    "transformers' `Trainer` runs its own smp path, unchanged (verified with transformers "
    "4.46.3 and accelerate 1.1.1, the `test` extras, and with 4.57.6 and accelerate 1.12.0, "
    "which `make install` puts in `.hf-newest`): it turns smp on when "
    "`SM_HP_MP_PARAMETERS` holds `partitions` (the estimator keeps the user's key), "
    "`SM_FRAMEWORK_PARAMS` has `sagemaker_mpi_enabled` and `smdistributed` imports; "
    "`smdistributed.modelparallel.__version__` is the smp API release implemented (1.16.0), so "
    "it takes its smp >= 1.10 code. train, evaluate, predict, `save_model` (a directory plain "
    "`from_pretrained` loads), checkpoints and `resume_from_checkpoint` work, at pipeline 2 "
    "and at tensor parallel 2 (GPT-2's blocks split at wrap time; a tensor-parallel job still "
    "needs the `partitions` key, e.g. `\"partitions\": 1`).", "",
    "- What it calls: `smp.init`, `smp.DistributedModel` (wrapped again by `evaluate()` / "
    "`predict()` before `train()`: the same module returns the same model), "
    "`smp.DistributedOptimizer` and `.clip_master_grads`, `@smp.step` bodies returning "
    "`ModelOutput`s (any picklable value crosses pipeline stages), `StepOutput.reduce_mean` / "
    "`.concat` (and `.detach()` first, from 4.47), `smp.allgather`, `smp.barrier`, `model.state_dict()`, "
    "`optimizer.local_state_dict(gather_if_shard=False)`, `smp.save(..., partial=True, v3=...)`"
    ", `smp.load(..., partial=True)`, `register_post_step_hook` (the resumed optimizer state, "
    "applied once after the first step), `smp.resume_from_checkpoint(..., partial=False)` and "
    "`smp.state.module_manager.translate_functions` (empty: state dicts already have the plain "
    "module's keys).",
    "- Data: accelerate shards the loaders over every process, and the pipeline computes "
    "pipeline rank 0's batches, as smp does (stages > 0 run the forward with stage 0's "
    "arguments); evaluate() and predict() report pipeline rank 0's rows, and predict()'s "
    "gathered predictions hold one copy per process of the pipeline. With tensor parallelism "
    "(prescaled_batch off) each TP rank is a data-parallel rank with its own rows.",
    "- On a CPU: transformers' device setup under smp is `torch.device(\"cuda\", "
    "smp.local_rank())`; override `TrainingArguments._setup_devices` to return "
    "`smp.state.device` (tests/scripts/hf_trainer_train.py).",
    "- Resume needs `save_safetensors=False` (transformers' smp branch resumes from "
    "`pytorch_model.bin` by name); with torch >= 2.6 set `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1` "
    "(transformers 4.46.3 reads its own rng_state.pth with a bare `torch.load`).",
    "- The optimizer: from 4.47 Trainer passes it to `accelerator.prepare`, which wraps any "
    "`torch.optim.Optimizer`. Under fp16 `smp.DistributedOptimizer` is none (as smp v1's FP16 "
    "optimizer), so accelerate leaves it as it is, and Trainer builds its LR scheduler on "
    "`optimizer.optimizer`; without fp16 it is a `torch.optim.Optimizer`.",
    "- transformers 5.x keeps the smp branch but breaks it: 5.0.0 trains, evaluates, predicts "
    "and saves (pipeline 2, fp16), yet cannot resume (it always writes `model.safetensors`, "
    "has no `save_safetensors`, and its smp branch resumes from `pytorch_model.bin` by name); "
    "5.25.0 never creates the optimizer once smp has wrapped the model (its "
    "`_prepare_for_training` delays creation under smp, then prepares `None`). Use 4.x "
    "(<= 4.57) for Trainer's smp path.",
    "",
]


def _default(value) -> str:
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, types.ModuleType):
        return value.__name__
    return repr(value)


def signature(obj, *, drop_self: bool = False) -> str:
    """`(a: int, b=2, *, c=None)` with annotations as written and readable defaults."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return ""
    parts, star_done = [], False
    params = list(sig.parameters.values())
    if drop_self and params and params[0].name in ("self", "cls"):
        params = params[1:]
    for p in params:
        if p.kind is p.KEYWORD_ONLY and not star_done:
            parts.append("*")
            star_done = True
        text = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        star_done |= p.kind is p.VAR_POSITIONAL
        if p.annotation is not p.empty:
            ann = p.annotation if isinstance(p.annotation, str) else inspect.formatannotation(
                p.annotation)
            text += f": {ann}"
        if p.default is not p.empty:
            text += f" = {_default(p.default)}" if p.annotation is not p.empty else \
                f"={_default(p.default)}"
        parts.append(text)
    ret = sig.return_annotation
    arrow = "" if ret is sig.empty else f" -> {ret if isinstance(ret, str) else inspect.formatannotation(ret)}"
    return f"({', '.join(parts)}){arrow}"


def first_line(obj, name: str) -> str:
    if not isinstance(obj, (type, types.FunctionType, types.ModuleType, types.BuiltinFunctionType)) \
            and not callable(obj):
        doc = ""  # an instance: its class's docstring would describe the class, not the value
    else:
        doc = inspect.getdoc(obj) or ""
    line = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
    return line or FALLBACK.get(name, "")


def describe(name: str, obj) -> list[str]:
    if isinstance(obj, enum.Enum):
        return [f"- `smp.{name}`: `{type(obj).__name__}.{obj.name}` (module alias)."]
    if isinstance(obj, type) and issubclass(obj, enum.Enum):
        names = ", ".join(m.name for m in obj)
        return [f"- `smp.{name}` (enum: {names}): {first_line(obj, name)}"]
    if isinstance(obj, types.ModuleType):
        return [f"- `smp.{name}` (module): {first_line(obj, name)}"]
    if name == "state":
        return [f"- `smp.state`: the runtime state `smp.init()` fills: `.cfg` (the smp "
                "parameters, e.g. `smp.state.cfg.fp16`), `.topology`, `.groups`, `.device`, "
                "`.model`, `.optimizer`, `.module_manager` (`.translate_functions`: the "
                "(smp_to_hf, hf_to_smp) state-dict pairs transformers' `save_pretrained` "
                "applies)."]
    if isinstance(obj, type) and issubclass(obj, BaseException):
        bases = ", ".join(b.__name__ for b in obj.__bases__)
        return [f"- `smp.{name}({bases})`: {first_line(obj, name)}"]
    lines = [f"- `smp.{name}{signature(obj)}`: {first_line(obj, name)}"]
    if isinstance(obj, type):
        lines += class_members(obj)
    return lines


def method_line(cls: type, attr: str, func) -> str:
    own = (getattr(func, "__doc__", None) or "").strip()
    line = inspect.cleandoc(own).split("\n\n")[0].replace("\n", " ") if own else ""
    return line or METHOD_FALLBACK.get(f"{cls.__name__}.{attr}", "")


def class_members(cls: type) -> list[str]:
    out = []
    for attr, text in ATTRIBUTES.get(cls.__name__, []):
        out.append(f"  - `.{attr}`: {text}")
    seen: set[str] = set()
    # The class's own members, then those of its bases defined in fp16_sdk (DistributedModel's
    # local views and state dicts live in base classes of their own modules).
    own = [c for c in cls.__mro__ if c.__module__.startswith("fp16_sdk.")]
    for attr, value in ((a, v) for c in own for a, v in vars(c).items()):
        if attr.startswith("_") or attr in seen:
            continue
        seen.add(attr)
        if isinstance(value, property):
            out.append(f"  - `.{attr}` (property): {method_line(cls, attr, value.fget)}")
        elif callable(value):
            out.append(f"  - `.{attr}{signature(value, drop_self=True)}`: "
                       f"{method_line(cls, attr, value)}")
    return out


def nn_section() -> list[str]:
    lines = ["", "`smp.nn` (sizes are global across the tensor-parallel ranks):", ""]
    for name in smp.nn.__all__:
        obj = getattr(smp.nn, name)
        if isinstance(obj, types.ModuleType):
            lines += hf_section(name, obj)
            continue
        lines.append(f"- `smp.nn.{name}{signature(obj)}`: {first_line(obj, name)}")
    return lines


def submodule_section(sub: str) -> list[str]:
    module = getattr(smp, sub)
    lines = [""]
    for name in module.__all__:
        obj = getattr(module, name)
        lines.append(f"- `smp.{sub}.{name}{signature(obj)}`: {first_line(obj, name)}")
    return lines


def hf_section(name: str, package: types.ModuleType) -> list[str]:
    """smp.nn.huggingface: the package line, then each architecture module's functions."""
    lines = [f"- `smp.nn.{name}` (module): {first_line(package, name)}"]
    for arch in package.__all__:
        module = getattr(package, arch)
        if not isinstance(module, types.ModuleType):
            continue
        lines.append(f"  - `smp.nn.{name}.{arch}`: {first_line(module, arch)}")
        for fn in module.__all__:
            if fn != "ARCH":
                obj = getattr(module, fn)
                lines.append(f"    - `{fn}{signature(obj)}`: {first_line(obj, fn)}")
    return lines


def render() -> str:
    exported = list(smp.__all__)
    grouped = {n for _, names in GROUPS for n in names}
    lines = ["# Runtime API reference (`smdistributed.modelparallel.torch`)", "",
             "Generated from `fp16_sdk.modelparallel.torch` by `python3 tools/gen_api_docs.py`; "
             "do not edit by hand.",
             "`import smdistributed.modelparallel.torch as smp` resolves to this package. "
             "Signatures are the runtime's own; the behaviour follows SageMaker's model "
             "parallelism library v1 (see `docs/architecture.md`).", ""]
    missing = []
    for title, names in GROUPS:
        lines += [f"## {title}", ""]
        for name in names:
            if name not in exported:
                missing.append(name)
                continue
            lines += describe(name, getattr(smp, name))
        if title == "Tensor-parallel modules":
            lines += nn_section()
        if title == "Mixed precision, optimizers, utilities":
            for sub in ("amp", "optimizers", "utils"):
                lines += submodule_section(sub)
        lines.append("")
    rest = [n for n in exported if n not in grouped]
    if rest:
        lines += ["## Other names", ""]
        for name in rest:
            lines += describe(name, getattr(smp, name))
        lines.append("")
    lines += HF_TRAINER
    if missing:
        lines += ["## Not provided yet", "",
                  "Part of the smp v1 API but not exported by this runtime yet; calling them "
                  "raises AttributeError:", ""]
        lines += [f"- `smp.{n}`: {FALLBACK.get(n, '')}" for n in missing]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare with the committed page")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python3 tools/gen_api_docs.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
