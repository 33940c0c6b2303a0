"""Generate docs/configuration.md from the pydantic schema in fp16_sdk/config.py.

Run `python3 tools/gen_config_docs.py` after changing the schema; a test checks the committed
file matches what this prints.
"""

from __future__ import annotations

import sys
from typing import Literal, get_args, get_origin
from pathlib import Path

from pydantic import BaseModel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fp16_sdk.config import MPIConfig, SMPParameters

OUT = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"

HEADER = """# Configuration reference

Generated from `fp16_sdk/config.py` by `python3 tools/gen_config_docs.py`; do not edit by hand.
The same schema validates `distribution` in the estimator (before anything starts) and the
`mp_parameters` that `smp.init()` reads inside the job. Unknown keys are errors that suggest the
closest known key.

```python
distribution = {
    "smdistributed": {"modelparallel": {"enabled": True, "parameters": {...}}},  # or a JSON file path
    "mpi": {"enabled": True, "processes_per_host": 2, "custom_mpi_options": "-x NCCL_DEBUG=INFO"},
}
```
"""

RULES = """
## Rules across keys
- `tensor_parallel_degree > 1` needs `ddp: True`.
- `fp16` and `bf16` are exclusive; `ddp` and `horovod` are exclusive.
- `default_partition < pipeline_parallel_degree`, and it is required when `auto_partition` is False.
- `memory_weight` in [0, 1]; its default is 0.8, or 0.2 with `optimize: "speed"`.
- `active_microbatches` defaults to `pipeline_parallel_degree + 2`.
- Not implemented, refused with an error before anything starts: `sharded_data_parallel_degree`
  above 1 and `offload_activations: True`. The `sdp_*` keys configure sharded data parallelism
  only: with `sharded_data_parallel_degree` 1 they are accepted and, as in smp, have no effect
  (AWS's GPT-2 example passes `sdp_gradient_clipping` and `sdp_hierarchical_allgather` always).
- `static_mode`, `fast_mode` and `_match_weights` (keys AWS's example scripts pass; AWS's
  tables do not list them) name pipeline execution/initialisation choices that this runtime
  always makes (one schedule replayed every step, direct stage-to-stage transfers, TP shards
  cut from the original weights); either value runs the same way, numerics unchanged.
- World size: `instance_count * processes_per_host` must be divisible by
  `pipeline_parallel_degree * tensor_parallel_degree` (checked by the estimator when
  `processes_per_host` is given, else by `smp.init()`); `rdp = world / (pp * tp)`.
"""


def _type(field) -> str:
    ann = field.annotation
    args = [a for a in get_args(ann) if a is not type(None)]
    if get_origin(ann) is Literal:
        return " or ".join(repr(a) for a in args)
    if args:  # Optional[X]
        return _type(type("F", (), {"annotation": args[0]}))
    return ann.__name__


def table(model: type[BaseModel]) -> str:
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        key = f"`{name}`" + (f" (alias `{field.alias}`)" if field.alias else "")
        default = "computed" if field.default is None and name in (
            "memory_weight", "active_microbatches") else repr(field.default)
        rows.append(f"| {key} | `{_type(field)}` | `{default}` | {field.description} |")
    return "\n".join(rows)


def render() -> str:
    return (HEADER + "\n## smdistributed.modelparallel.parameters\n\n" + table(SMPParameters)
            + "\n\n## mpi\n\n" + table(MPIConfig) + "\n" + RULES)


if __name__ == "__main__":
    if "--check" in sys.argv:
        sys.exit(0 if OUT.read_text() == render() else 1)
    OUT.write_text(render())
    print(f"wrote {OUT}")
