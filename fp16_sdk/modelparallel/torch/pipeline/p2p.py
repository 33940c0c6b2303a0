"""Point-to-point transfer of any picklable Python value holding tensors between pipeline stages.

A message is: a fixed-size int64 header (skeleton byte length, tensor count, then dtype code,
rank and sizes of each tensor; when that is longer than the fixed size, the fixed header holds
minus its length and the long header follows), the skeleton, then each tensor. The skeleton is the value
pickled with every tensor replaced by a persistent id (its slot number, pickle's own hook for
out-of-band objects), so whatever the model returns crosses stages as it is: tensors, None,
Python scalars and strings, tuples, dicts, Hugging Face `ModelOutput`s (ordered-dict
dataclasses), named tuples, dataclasses and user objects, nested in any way. A tensor that
appears twice is sent once and arrives as one object. Sends are `isend`s whose work is held
until `flush()`, so a send never blocks the executor; receives wait. An isend reads its tensor
when the transfer runs, later: a sent tensor is held until its send has completed and must not
change before then (the executor sends a `snapshot` of what a step body can change in place). Every
message between one ordered pair of ranks is posted in schedule order, which is what NCCL (no
tags) and Gloo both match.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
import torch.distributed as dist

from ..errors import SMPError

__all__ = ["PipelineCommError", "TensorChannel", "flatten", "unflatten", "snapshot"]

_HEADER = 256
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]


class PipelineCommError(SMPError, RuntimeError):
    """A pipeline message that cannot be encoded (too many tensors or dimensions, or a value
    pickle cannot serialise)."""


class _TensorPickler(pickle.Pickler):
    """Pickles a value with its tensors left out, collected in `tensors` (first-seen order)."""

    def __init__(self, file, tensors: list):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors = tensors
        self._slots: dict[int, int] = {}

    def persistent_id(self, obj):
        if isinstance(obj, torch.Tensor):
            slot = self._slots.get(id(obj))
            if slot is None:
                slot = self._slots[id(obj)] = len(self.tensors)
                self.tensors.append(obj)
            return slot
        return None


class _TensorUnpickler(pickle.Unpickler):
    def __init__(self, file, tensors: list):
        super().__init__(file)
        self.tensors = tensors

    def persistent_load(self, slot):
        return self.tensors[slot]


def flatten(obj: Any) -> tuple[bytes, list[torch.Tensor]]:
    """(skeleton, tensors): obj pickled without its tensors, and those tensors (once each, in
    the order pickle meets them, which is the same for a value and its `unflatten` copy).

    Raises:
        PipelineCommError: obj (or something inside it) cannot be pickled.
    """
    tensors: list[torch.Tensor] = []
    buf = io.BytesIO()
    try:
        _TensorPickler(buf, tensors).dump(obj)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise PipelineCommError(f"a value crossing a pipeline stage boundary cannot be pickled "
                                f"({type(obj).__name__}: {exc}); the model's outputs (and its "
                                f"blocks' outputs) must be tensors or picklable objects "
                                f"holding them") from exc
    return buf.getvalue(), tensors


def unflatten(skeleton: bytes, tensors: list[torch.Tensor]) -> Any:
    """Inverse of `flatten`: the value, with `tensors` in their slots."""
    return _TensorUnpickler(io.BytesIO(skeleton), tensors).load()


def snapshot(obj: Any) -> Any:
    """A copy of obj whose tensors are detached clones: what an `isend` may read later, when
    the owner of obj has changed it in place."""
    skeleton, tensors = flatten(obj)
    return unflatten(skeleton, [t.detach().clone() for t in tensors])


class TensorChannel:
    """Sends and receives structures to and from other global ranks of one process group.

    Args:
        group: the process group the peers belong to (the pipeline group), or None for world.
        device: where received tensors (and headers, for NCCL) live.
        failure: the job's FailureSignal (failure.py): waits end when another stage failed.
    """

    def __init__(self, group, device: torch.device, failure=None):
        self.group = group
        self.device = device
        self.failure = failure
        self._pending: list[tuple[Any, Any]] = []  # (work, tensor kept alive or None)

    def _isend(self, tensor: torch.Tensor, dst: int) -> None:
        tensor = tensor.contiguous()
        self._pending.append((dist.isend(tensor, dst, group=self.group), tensor))

    def _wait(self, work) -> None:
        if self.failure is None:
            work.wait()
        else:
            self.failure.wait(work)

    def _recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        self._wait(dist.irecv(tensor, src, group=self.group))
        return tensor

    def _release_sent(self) -> None:
        """Drop the tensors of completed sends (their work stays, for flush to wait on)."""
        self._pending = [(w, t if t is not None and not w.is_completed() else None)
                         for w, t in self._pending]

    def send(self, obj: Any, dst: int) -> None:
        """Post the sends of `obj` (tensors are sent detached, as they are) to global rank dst."""
        self._release_sent()
        blob, tensors = flatten(obj)
        header = [len(blob), len(tensors)]
        for t in tensors:
            if t.dtype not in _DTYPES:
                raise PipelineCommError(f"cannot send a {t.dtype} tensor between stages; "
                                        f"supported: {_DTYPES}")
            header += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
        head = torch.zeros(_HEADER, dtype=torch.int64)
        if len(header) > _HEADER:  # a long one follows the fixed one, which gives its length
            head[0] = -len(header)
            self._isend(head.to(self.device), dst)
            head = torch.tensor(header, dtype=torch.int64)
        else:
            head[:len(header)] = torch.tensor(header, dtype=torch.int64)
        self._isend(head.to(self.device), dst)
        self._isend(torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(self.device), dst)
        for t in tensors:
            self._isend(t.detach(), dst)

    def recv(self, src: int) -> Any:
        """Receive one structure from global rank src (blocks until it is there)."""
        head = self._recv(torch.empty(_HEADER, dtype=torch.int64, device=self.device),
                          src).tolist()
        if head[0] < 0:  # a long header follows
            head = self._recv(torch.empty(-head[0], dtype=torch.int64, device=self.device),
                              src).tolist()
        blob_len, count = head[0], head[1]
        blob = torch.empty(blob_len, dtype=torch.uint8, device=self.device)
        tensors, i = [], 2
        for _ in range(count):
            dtype, ndim = _DTYPES[head[i]], head[i + 1]
            tensors.append(torch.empty(head[i + 2:i + 2 + ndim], dtype=dtype, device=self.device))
            i += 2 + ndim
        works = [dist.irecv(t, src, group=self.group) for t in [blob] + tensors]  # in order
        for work in works:
            self._wait(work)
        skeleton = blob.cpu().numpy().tobytes()
        return unflatten(skeleton, tensors)

    def flush(self) -> None:
        """Wait for every posted send (end of step)."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            self._wait(work)
