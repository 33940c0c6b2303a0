"""Which stage owns which module: contiguous stages over the model's chain of modules.

The unit of placement is a module. The model is read as `pre -> blocks[0..n-1] -> post`: the
blocks are the children of the largest `nn.ModuleList`/`nn.Sequential` in the tree (by
parameter count, at least two children; `DistributedTransformer`'s layer list qualifies), or,
in a model without one (AWS's MNIST `Net`), the children of the first module met going down
from the root that has two or more (a plain `nn.Module` with conv/linear children used with
functional ops between them). Along the path from the root to the blocks' parent, the
siblings registered before the path are `pre` (embeddings: stage 0) and those registered after
it `post` (final norm, LM head: the last stage). These pre, block and post modules are the
units the engine places (pipeline/trace.py); the ancestors on the path (the "parent" modules)
run on every stage. Registration order stands for call order; the first step's trace checks
the real order and refuses a partition whose stages would go down along it.

Automatic partitioning balances, over contiguous runs of blocks (each stage at least one), the
cost `memory_weight * param_share + (1 - memory_weight) * compute_share`, where param_share is
a module's parameter count over the model's, and compute_share its count of parameters that
take part in matrix products (all but embedding tables: a dense layer costs 2 FLOPs per
parameter per token, a table lookup none) over the model's. pre's cost is added to stage 0 and
post's to the last stage; the split minimises the largest stage cost (exact dynamic programme,
n*n*p). The decision is pure arithmetic on the module tree, so every rank makes the same one
without communicating.

Manual partitioning (`auto_partition: False`): a block's stage is the innermost
`smp.partition(i)` / `smp.set_partition(module, i)` recorded on it or an ancestor, else
`default_partition`; the stages must not decrease along the block list and every stage needs a
block. A stage recorded on any other module must be the one it runs on (pre: 0, post: the
last, a module inside a block: the block's), else the partition is refused naming the module:
a placement asked for is never silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from ..errors import SMPConfigError
from ..param_record import full_numel_of  # delayed init's placeholders count as created

__all__ = ["Partition", "find_blocks", "balance", "auto_partition", "manual_partition"]


@dataclass(frozen=True)
class Partition:
    """The decision.

    Attributes:
        num_stages: p.
        blocks_path: qualified name of the blocks' parent ("" when it is the root).
        block_stage: stage of each block, non-decreasing.
        block_names: qualified name of each block.
        pre, post: names of the modules run before / after the blocks.
        param_stage: owning stage of every parameter, by qualified name.
        mode: "auto" or "manual".
    """

    num_stages: int
    blocks_path: str
    block_stage: tuple[int, ...]
    pre: tuple[str, ...]
    post: tuple[str, ...]
    param_stage: dict[str, int]
    mode: str
    block_names: tuple[str, ...] = ()

    def block_name(self, i: int) -> str:
        return self.block_names[i]

    def unit_stages(self) -> dict[str, int]:
        """Qualified name -> stage of every placed module (pre, blocks, post)."""
        units = {name: 0 for name in self.pre}
        units.update(zip(self.block_names, self.block_stage))
        units.update({name: self.num_stages - 1 for name in self.post})
        return units

    def describe(self, module: nn.Module) -> str:
        """Log text: module -> stage and parameter counts per stage."""
        params = dict(module.named_parameters())
        per_stage = [0] * self.num_stages
        for name, stage in self.param_stage.items():
            per_stage[stage] += params[name].numel()
        lines = [f"pipeline partition ({self.mode}) into {self.num_stages} stages:"]
        for name in self.pre:
            lines.append(f"  {name} -> stage 0 (before the blocks)")
        for i, s in enumerate(self.block_stage):
            n = sum(p.numel() for p in module.get_submodule(self.block_name(i)).parameters())
            lines.append(f"  {self.block_name(i)} -> stage {s} ({n} parameters)")
        for name in self.post:
            lines.append(f"  {name} -> stage {self.num_stages - 1} (after the blocks)")
        lines.append("  parameters per stage: " + ", ".join(
            f"stage {s}: {n}" for s, n in enumerate(per_stage)))
        return "\n".join(lines)


def _count(module: nn.Module) -> int:
    return sum(full_numel_of(p) for p in module.parameters())


def find_blocks(module: nn.Module) -> tuple[str, list[str]]:
    """(qualified name of the blocks' parent, qualified names of the blocks), module doc.

    Raises:
        SMPConfigError: no module with at least two children.
    """
    best: tuple[int, int, str, nn.Module] | None = None
    for name, sub in module.named_modules():
        if isinstance(sub, (nn.ModuleList, nn.Sequential)) and len(sub) >= 2:
            key = (_count(sub), -name.count("."))
            if best is None or key > best[:2]:
                best = (*key, name, sub)
    if best is None:
        path, node = "", module
        while len(list(node.children())) == 1:
            child_name, node = next(iter(node.named_children()))
            path = f"{path}.{child_name}" if path else child_name
        if len(list(node.children())) < 2:
            raise SMPConfigError(
                f"pipeline_parallel_degree > 1 needs the model ({type(module).__name__}) to "
                f"have at least two submodules to place on stages; it has "
                f"{len(list(module.modules())) - 1}", key="pipeline_parallel_degree")
        best = (0, 0, path, node)
    path, parent = best[2], best[3]
    return path, [f"{path}.{n}" if path else n for n, _ in parent.named_children()]


def _pre_post(module: nn.Module, blocks_path: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Siblings of the root-to-blocks path registered before it (pre) and after it (post)."""
    pre, post, node, prefix = [], [], module, ""
    for part in blocks_path.split(".") if blocks_path else []:
        seen_path = False
        for name, child in node.named_children():
            if name == part:
                seen_path = True
            else:
                (post if seen_path else pre).append(prefix + name)
        node, prefix = getattr(node, part), f"{prefix}{part}."
    return tuple(pre), tuple(post)


def _compute_params(module: nn.Module) -> int:
    """Parameters used in matrix products: everything but embedding tables."""
    tables = {id(p) for m in module.modules() if isinstance(m, nn.Embedding) or
              "Embedding" in type(m).__name__ for p in m.parameters(recurse=False)}
    return sum(full_numel_of(p) for p in module.parameters() if id(p) not in tables)


def _param_owners(module, blocks, block_stage, pre, post, p) -> dict[str, int]:
    owner_of_module = {name: 0 for name in pre}
    owner_of_module.update({name: p - 1 for name in post})
    owner_of_module.update(dict(zip(blocks, block_stage)))
    owners = {}
    for pname, _ in module.named_parameters():
        stage, best = 0, -1
        for mname, s in owner_of_module.items():
            if (mname == "" or pname.startswith(f"{mname}.")) and len(mname) > best:
                stage, best = s, len(mname)
        owners[pname] = stage
    return owners


def balance(costs: list[float], p: int, *, first_extra: float = 0.0,
            last_extra: float = 0.0) -> list[int]:
    """Stage of each block: contiguous, every stage non-empty, minimising the largest stage cost.

    Raises:
        SMPConfigError: fewer blocks than stages.
    """
    n = len(costs)
    if n < p:
        raise SMPConfigError(f"pipeline_parallel_degree ({p}) must not exceed the number of "
                             f"blocks ({n}) in the model's layer list; lower it or use more "
                             f"layers", key="pipeline_parallel_degree", value=p)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][j]: smallest max-cost splitting blocks[0:j] into stages 0..k-1
    best = [[inf] * (n + 1) for _ in range(p + 1)]
    cut = [[0] * (n + 1) for _ in range(p + 1)]
    best[0][0] = 0.0
    for k in range(1, p + 1):
        for j in range(k, n - (p - k) + 1):
            for i in range(k - 1, j):
                load = prefix[j] - prefix[i] + (first_extra if k == 1 else 0.0)
                load += last_extra if k == p else 0.0
                value = max(best[k - 1][i], load)
                if value < best[k][j] - 1e-12:
                    best[k][j], cut[k][j] = value, i
    stages, j = [0] * n, n
    for k in range(p, 0, -1):
        i = cut[k][j]
        for b in range(i, j):
            stages[b] = k - 1
        j = i
    return stages


def auto_partition(module: nn.Module, p: int, memory_weight: float) -> Partition:
    """Balanced contiguous partition (module docstring).

    Raises:
        SMPConfigError: no block list, or fewer blocks than stages.
    """
    path, blocks = find_blocks(module)
    pre, post = _pre_post(module, path)
    total_params = max(_count(module), 1)
    total_compute = max(_compute_params(module), 1)

    def cost(name: str) -> float:
        sub = module.get_submodule(name)
        return (memory_weight * _count(sub) / total_params +
                (1 - memory_weight) * _compute_params(sub) / total_compute)

    stages = balance([cost(name) for name in blocks], p,
                     first_extra=sum(cost(n) for n in pre), last_extra=sum(cost(n) for n in post))
    owners = _param_owners(module, blocks, stages, pre, post, p)
    return Partition(p, path, tuple(stages), pre, post, owners, "auto", tuple(blocks))


def manual_partition(module: nn.Module, p: int, *,
                     recorded: Callable[[nn.Module], int | None], default: int) -> Partition:
    """Partition from smp.partition / set_partition records.

    Args:
        recorded: module -> the stage recorded for it, or None.
        default: default_partition.

    Raises:
        SMPConfigError: a stage out of range, stages decreasing along the blocks, or a stage
            without blocks.
    """
    path, blocks = find_blocks(module)
    pre, post = _pre_post(module, path)
    chain = [module] + [module.get_submodule(".".join(path.split(".")[:k]))
                        for k in range(1, len(path.split(".")) + 1)] if path else [module]
    stages = []
    for name in blocks:
        stage = default
        for m in chain + [module.get_submodule(name)]:  # outermost first: innermost wins
            stage = recorded(m) if recorded(m) is not None else stage
        if not 0 <= stage < p:
            raise SMPConfigError(f"partition index ({stage}) of {name} must be in "
                                 f"0..{p - 1} (pipeline_parallel_degree {p})",
                                 key="default_partition", value=stage)
        stages.append(stage)
    empty = sorted(set(range(p)) - set(stages))
    if any(b < a for a, b in zip(stages, stages[1:])) or empty:
        raise SMPConfigError(
            f"manual partition {stages} of the blocks of '{path}' must be non-decreasing and "
            f"give every stage a block (stages without one: {empty}); use smp.partition(i) "
            f"or smp.set_partition so stage indices rise along the layers",
            key="auto_partition", value=False)
    partition = Partition(p, path, tuple(stages), pre, post,
                          _param_owners(module, blocks, stages, pre, post, p), "manual",
                          tuple(blocks))
    _check_records(module, partition, recorded, {id(m) for m in chain})
    return partition


def _check_records(module: nn.Module, partition: Partition, recorded, chain: set[int]) -> None:
    """Refuse a recorded stage that the partition does not give its module (module doc)."""
    units = partition.unit_stages()
    layers = f"'{partition.blocks_path}'" if partition.blocks_path else "the root module"
    for name, sub in module.named_modules():
        wanted = recorded(sub)
        if wanted is None or id(sub) in chain or name in partition.block_names:
            continue  # ancestors of the blocks run everywhere; blocks were placed above
        unit = next((u for u in units if name == u or name.startswith(f"{u}.")), None)
        if unit is None or units[unit] == wanted:
            continue
        if unit in partition.pre or unit in partition.post:
            where = "before" if unit in partition.pre else "after"
            why = f"modules registered {where} the layers of {layers} run on stage {units[unit]}"
        else:
            why = f"the unit of placement is its layer '{unit}', on stage {units[unit]}"
        raise SMPConfigError(
            f"smp.partition / smp.set_partition put module '{name}' on pipeline stage "
            f"{wanted}, but it would run on stage {units[unit]}: {why}. Set the partition of "
            f"the layers (children of {layers}) instead, or remove this one",
            key="partition", value=wanted)
