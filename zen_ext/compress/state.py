"""All sparsifier memory of one Synchronizer, keyed by parameter name, and its checkpoint format.

DGC keeps per parameter a residual (the accumulated, not yet sent velocity ``v``), a momentum ``u``
when momentum correction is on, and the last threshold; the warm-up schedule and the sampling offsets
follow one step counter. Everything is keyed by the parameter's name, never by a bucket index,
because DDP rebuilds buckets after the first iteration and DeepSpeed re-buckets by size
(research/style.md, "state is explicit, keyed stably and serializable").

``state_dict()`` holds CPU copies of the tensors and plain Python values only (no process group,
no device), so it goes into any engine checkpoint; ``load_state_dict`` keeps them on the CPU and
each tensor moves to its gradient's device on first use.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

STATE_FORMAT = "zen_ext.sparsifier_state"
STATE_VERSION = 1


class SparsifierState:
    """Per-parameter sparsifier tensors plus the step counter.

    Tuning note: nothing here is tuned; its size is what to watch. DGC costs one fp32 residual per
    compressed element, two with momentum correction.
    """

    __slots__ = ("step", "params")

    def __init__(self) -> None:
        self.step = 0
        """Optimizer steps taken (``end_step`` calls); drives warm-up and the sampling offsets."""
        self.params: dict[str, dict[str, torch.Tensor]] = {}
        """name → {"residual", "momentum", "threshold"} (only those in use)."""

    def tensor(self, name: str, key: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The flat ``key`` tensor of parameter ``name``, created as zeros on first use.

        A tensor restored by ``load_state_dict`` moves to ``device`` and ``dtype`` here.

        A stored tensor of another numel restarts from zeros, with a warning: the slice this memory
        belongs to changed size (node shards re-cut after a bucket rebuild, or a checkpoint from
        another model or parallel layout), so its old elements no longer line up.
        """
        entry = self.params.setdefault(name, {})
        t = entry.get(key)
        if t is not None and t.numel() != numel:
            log.warning("zen: sparsifier memory %r.%s restarts from zeros: it has %d elements but the gradient "
                        "has %d (a changed bucket/shard layout, or a checkpoint of another model or layout)",
                        name, key, t.numel(), numel)
            t = None
        if t is None:
            t = entry[key] = torch.zeros(numel, dtype=dtype, device=device)
        elif t.device != torch.device(device) or t.dtype != dtype:
            t = entry[key] = t.to(device=device, dtype=dtype)
        return t

    def set(self, name: str, key: str, value: torch.Tensor) -> None:
        self.params.setdefault(name, {})[key] = value

    def get(self, name: str, key: str) -> torch.Tensor | None:
        return self.params.get(name, {}).get(key)

    def state_dict(self) -> dict:
        """A checkpointable copy: CPU tensors and plain values, no process group."""
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "step": self.step,
            "params": {name: {k: t.detach().to("cpu", copy=True) for k, t in entry.items()}
                       for name, entry in sorted(self.params.items())},
        }

    def load_state_dict(self, sd: dict) -> None:
        """Replace this state by ``sd`` (from ``state_dict``).

        Raises:
            ValueError: ``sd`` is not a sparsifier state of a supported version.
        """
        if not isinstance(sd, dict) or sd.get("format") != STATE_FORMAT:
            raise ValueError(f"sparsifier state_dict must have format {STATE_FORMAT!r}, got "
                             f"{sd.get('format') if isinstance(sd, dict) else type(sd).__name__!r}")
        if sd.get("version") != STATE_VERSION:
            raise ValueError(f"sparsifier state_dict version ({sd.get('version')!r}) must be {STATE_VERSION}")
        self.step = int(sd["step"])
        self.params = {name: {k: t.detach().clone() for k, t in entry.items()} for name, entry in sd["params"].items()}
