"""Gradient traces: record the per-rank sparse gradients of a real run, replay them into any scheme.

File format (``TRACE_FORMAT`` = ``"zen_ext.trace/1"``): one file per training step, named
``step_{step:08d}.pt`` in the trace directory, written by rank 0 with ``torch.save`` and read back with
``torch.load(..., weights_only=True)`` (plain containers of tensors, ints and strings; no pickled code)::

    {
      "format": "zen_ext.trace/1",
      "step": int,
      "world_size": int,                      # ranks recorded
      "slices": {                             # one entry per synchronized slice (bucket, parameter)
        key: {
          "numel": int,                       # index space (rows in row form)
          "row_width": int,                   # 1: element form; W: values are [K, W]
          "dtype": str,                       # e.g. "torch.bfloat16"
          "ranks": [{"indices": int64 [K_r], "values": [K_r] or [K_r, W]}, ...],  # one per rank
        },
      },
    }

Indices are stored as given (duplicates and order kept), so a replay is bit-for-bit the recorded input.

Recording in a real run: wrap the scheme with ``TracingScheme(scheme, TraceRecorder(dir, comm))`` and
call ``recorder.end_step()`` once per optimizer step (every rank). The recorder gathers each slice to
rank 0 with ``all_gather_object``, which the Communicator does not count as traffic, so the run's byte
statistics are unchanged. Replaying: ``load_trace(path)`` → ``TraceStep`` objects whose ``slices`` map
each key to the per-rank ``SparseGrad`` list, ready for ``SimWorld(n).run``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..comm.base import Communicator
from ..core.scheme import SyncScheme
from ..core.types import SparseGrad, as_sparse

TRACE_FORMAT = "zen_ext.trace/1"


@dataclass
class TraceStep:
    """One recorded step: ``slices[key]`` is the list of the ranks' gradients of that slice."""

    step: int
    slices: dict[str, list[SparseGrad]] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return len(next(iter(self.slices.values()))) if self.slices else 0


def step_path(directory: str, step: int) -> str:
    return os.path.join(directory, f"step_{step:08d}.pt")


def save_step(path: str, step: TraceStep) -> None:
    """Write one step file (format in the module docstring)."""
    sizes = {len(v) for v in step.slices.values()}
    if len(sizes) > 1:
        raise ValueError(f"trace step {step.step} must have one gradient per rank in every slice, got {sorted(sizes)}")
    slices = {}
    for key, grads in step.slices.items():
        first = grads[0]
        slices[key] = {
            "numel": int(first.numel),
            "row_width": int(first.row_width),
            "dtype": str(first.dtype),
            "ranks": [{"indices": g.indices.detach().cpu(), "values": g.values.detach().cpu()} for g in grads],
        }
    payload = {"format": TRACE_FORMAT, "step": int(step.step), "world_size": step.world_size, "slices": slices}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    torch.save(payload, tmp)
    os.replace(tmp, path)  # a reader never sees a half-written step


def load_step(path: str) -> TraceStep:
    """Read one step file.

    Raises:
        ValueError: not a ``zen_ext.trace/1`` file, or inconsistent content.
    """
    data = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(data, dict) or data.get("format") != TRACE_FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"trace file {path} format ({found!r}) must be {TRACE_FORMAT!r}")
    step = TraceStep(int(data["step"]))
    for key, s in data["slices"].items():
        grads = []
        for r, entry in enumerate(s["ranks"]):
            vals = entry["values"]
            if str(vals.dtype) != s["dtype"] or (vals.dim() == 2 and vals.shape[1] != s["row_width"]):
                raise ValueError(f"trace file {path} slice {key!r} rank {r} does not match its dtype/row_width")
            grads.append(SparseGrad(entry["indices"], vals, int(s["numel"])))
        if len(grads) != data["world_size"]:
            raise ValueError(f"trace file {path} slice {key!r} has {len(grads)} ranks, expected {data['world_size']}")
        step.slices[key] = grads
    return step


def trace_files(path: str) -> list[str]:
    """The step files of a trace: ``path`` itself if it is a file, else its ``step_*.pt`` in order."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"trace path {path} must be a step file or a directory of them")
    files = sorted(f for f in os.listdir(path) if f.startswith("step_") and f.endswith(".pt"))
    if not files:
        raise FileNotFoundError(f"trace directory {path} has no step_*.pt files")
    return [os.path.join(path, f) for f in files]


def load_trace(path: str) -> Iterator[TraceStep]:
    """Iterate over the steps of a trace file or directory (lazily: one step in memory at a time)."""
    for f in trace_files(path):
        yield load_step(f)


class TraceRecorder:
    """Collects the gradients of every rank for each step and writes one file per step on rank 0.

    Args:
        directory: where ``step_XXXXXXXX.pt`` files go (created on rank 0).
        comm: the ranks whose gradients are recorded (``None``: a single process that calls
            ``add_all`` with every rank's gradients itself, e.g. from a SimWorld driver).
        start_step: number of the first step.
    """

    def __init__(self, directory: str, comm: Communicator | None = None, start_step: int = 0) -> None:
        self.directory = directory
        self.comm = comm
        self.step = start_step
        self._pending = TraceStep(start_step)

    def add(self, key: str, grad: SparseGrad | torch.Tensor) -> None:
        """Record this rank's gradient of slice ``key`` (a collective: every rank calls it, same order)."""
        sg = as_sparse(grad)
        entry = (key, sg.indices.detach().cpu(), sg.values.detach().cpu(), sg.numel)
        got = self.comm.all_gather_object(entry) if self.comm is not None else [entry]
        keys = {e[0] for e in got}
        if len(keys) != 1:
            raise RuntimeError(f"TraceRecorder.add: ranks recorded different slices {sorted(keys)} "
                               f"(rank {self.comm.rank} recorded {key!r})")
        self.add_all(key, [SparseGrad(i, v, m) for _, i, v, m in got])

    def add_all(self, key: str, grads: list[SparseGrad]) -> None:
        """Record slice ``key`` for all ranks at once (single-process drivers)."""
        if key in self._pending.slices:
            raise ValueError(f"trace slice key ({key!r}) must be unique within step {self.step}")
        self._pending.slices[key] = list(grads)

    @property
    def pending_count(self) -> int:
        """Slices recorded for the current step so far."""
        return len(self._pending.slices)

    def end_step(self) -> str | None:
        """Write the pending step (rank 0 only) and start the next; returns the path written, if any."""
        path = None
        if self._pending.slices and (self.comm is None or self.comm.rank == 0):
            path = step_path(self.directory, self.step)
            save_step(path, self._pending)
        self.step += 1
        self._pending = TraceStep(self.step)
        return path


class TracingScheme(SyncScheme):
    """Wraps a scheme: records every input gradient with a ``TraceRecorder``, then delegates.

    Slices without a key are recorded under ``"slice{i}"`` in call order within the step.
    """

    name = "tracing"

    def __init__(self, inner: SyncScheme, recorder: TraceRecorder) -> None:
        self.inner, self.recorder = inner, recorder
        self.lossless = inner.lossless

    def options(self) -> dict:
        return {"inner": self.inner.name, **self.inner.options()}

    def _sync(self, comm, grad, op, timings, key, out):
        if key is None:
            key = f"slice{self.recorder.pending_count}"
        self.recorder.add(key, grad)
        return self.inner.sync_validated(comm, grad, op, timings, key, out)
