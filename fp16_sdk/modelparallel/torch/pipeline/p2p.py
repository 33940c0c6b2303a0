"""Point-to-point transfer of nested tensor structures between pipeline stages.

A message is: a fixed-size int64 header (skeleton byte length, tensor count, then dtype code,
rank and sizes of each tensor), the pickled skeleton (the object with every tensor replaced by
a slot number: tuples, dicts, model-output classes, None and Python scalars survive), then
each tensor. Sends are `isend`s whose work (and tensors) are held until `flush()`, so a send
never blocks the executor; receives wait. Every message between one ordered pair of ranks is
posted in schedule order, which is what NCCL (no tags) and Gloo both match.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from ..errors import SMPError

__all__ = ["PipelineCommError", "TensorChannel", "flatten", "unflatten"]

_HEADER = 256
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]


class PipelineCommError(SMPError, RuntimeError):
    """A pipeline message that cannot be encoded (too many tensors or dimensions)."""


class _Slot:
    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __reduce__(self):
        return (_Slot, (self.index,))


def _rebuild(x: Any, walk) -> Any:
    """x with walk applied to its elements (containers keep their type and attributes)."""
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*[walk(v) for v in x])
    if isinstance(x, (list, tuple)):
        return type(x)(walk(v) for v in x)
    if isinstance(x, dict):  # dicts and dict-like model outputs (fields mirrored as attributes)
        out = x.__class__.__new__(x.__class__)
        dict.__init__(out, {k: walk(v) for k, v in x.items()})
        if hasattr(x, "__dict__"):
            out.__dict__.update({k: walk(v) for k, v in x.__dict__.items()})
        return out
    return x


def flatten(obj: Any) -> tuple[Any, list[torch.Tensor]]:
    """(skeleton, tensors): obj with its tensors replaced by slots, and those tensors (once each)."""
    tensors: list[torch.Tensor] = []
    slots: dict[int, _Slot] = {}

    def walk(x):
        if isinstance(x, torch.Tensor):
            if id(x) not in slots:
                slots[id(x)] = _Slot(len(tensors))
                tensors.append(x)
            return slots[id(x)]
        return _rebuild(x, walk)

    return walk(obj), tensors


def unflatten(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """Inverse of `flatten`."""
    def walk(x):
        return tensors[x.index] if isinstance(x, _Slot) else _rebuild(x, walk)

    return walk(skeleton)


class TensorChannel:
    """Sends and receives structures to and from other global ranks of one process group.

    Args:
        group: the process group the peers belong to (the pipeline group), or None for world.
        device: where received tensors (and headers, for NCCL) live.
    """

    def __init__(self, group, device: torch.device):
        self.group = group
        self.device = device
        self._pending: list[tuple[Any, Any]] = []  # (work, tensor kept alive)

    def _isend(self, tensor: torch.Tensor, dst: int) -> None:
        tensor = tensor.contiguous()
        self._pending.append((dist.isend(tensor, dst, group=self.group), tensor))

    def _recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        dist.irecv(tensor, src, group=self.group).wait()
        return tensor

    def send(self, obj: Any, dst: int) -> None:
        """Post the sends of `obj` (tensors are sent detached, as they are) to global rank dst."""
        skeleton, tensors = flatten(obj)
        blob = pickle.dumps(skeleton)
        header = [len(blob), len(tensors)]
        for t in tensors:
            if t.dtype not in _DTYPES:
                raise PipelineCommError(f"cannot send a {t.dtype} tensor between stages; "
                                        f"supported: {_DTYPES}")
            header += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
        if len(header) > _HEADER:
            raise PipelineCommError(f"a stage boundary carries {len(tensors)} tensors with "
                                    f"{len(header)} header words; at most {_HEADER} fit")
        head = torch.zeros(_HEADER, dtype=torch.int64)
        head[:len(header)] = torch.tensor(header, dtype=torch.int64)
        self._isend(head.to(self.device), dst)
        self._isend(torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(self.device), dst)
        for t in tensors:
            self._isend(t.detach(), dst)

    def recv(self, src: int) -> Any:
        """Receive one structure from global rank src (blocks until it is there)."""
        head = self._recv(torch.empty(_HEADER, dtype=torch.int64, device=self.device),
                          src).tolist()
        blob_len, count = head[0], head[1]
        blob = self._recv(torch.empty(blob_len, dtype=torch.uint8, device=self.device), src)
        skeleton = pickle.loads(blob.cpu().numpy().tobytes())
        tensors, i = [], 2
        for _ in range(count):
            dtype, ndim = _DTYPES[head[i]], head[i + 1]
            shape = head[i + 2:i + 2 + ndim]
            i += 2 + ndim
            tensors.append(self._recv(torch.empty(shape, dtype=dtype, device=self.device), src))
        return unflatten(skeleton, tensors)

    def flush(self) -> None:
        """Wait for every posted send (end of step)."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
