"""All sparsifier memory of one Synchronizer, keyed by parameter name, and its checkpoint format.

DGC keeps per parameter a residual (the accumulated, not yet sent velocity ``v``), a momentum ``u``
when momentum correction is on, and the last threshold; the warm-up schedule and the sampling offsets
follow one step counter. Everything is keyed by the parameter's name, never by a bucket index,
because DDP rebuilds buckets after the first iteration and DeepSpeed re-buckets by size
(research/style.md, "state is explicit, keyed stably and serializable").

DGC keeps the memory of one bucket in one flat buffer per kind (``flat``), and every parameter's
entry is a view of it, so a bucket is updated with a constant number of tensor operations whatever
its number of parameters; the views keep the checkpoint keyed by name. Per-parameter values that
DGC finds per selection unit (the threshold) are stored as (unit tensor, index) and materialized
only when read (``get``, ``state_dict``), so recording them costs no operation per parameter.

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

    __slots__ = ("step", "params", "_flats", "_lazy")

    def __init__(self) -> None:
        self.step = 0
        """Optimizer steps taken (``end_step`` calls); drives warm-up and the sampling offsets."""
        self.params: dict[str, dict[str, torch.Tensor]] = {}
        """name → {"residual", "momentum", "threshold"} (only those in use); a 4-bit residual is
        "residual_codes" and "residual_scales" (zen_ext/compress/dgc/int4.py)."""
        self._flats: dict[tuple[str, tuple[str, ...]], torch.Tensor] = {}
        """(key, names of a bucket) → the flat buffer whose views ``params[name][key]`` are."""
        self._lazy: dict[str, dict[str, tuple[torch.Tensor, int]]] = {}
        """name → {key: (tensor, index)}: a value recorded per selection unit, read as ``tensor[index]``."""

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

    def flat(self, names: tuple[str, ...], numels: tuple[int, ...], key: str, dtype: torch.dtype,
             device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One flat ``key`` buffer for the parameters ``names`` (in order), and its per-name views.

        1. Reuse: the cached buffer when every ``params[name][key]`` is still its view (the steady state:
           no tensor operation, only pointer checks).
        2. Build: otherwise (first use, a restored checkpoint, another dtype/device, a bucket rebuild)
           concatenate each name's tensor (``tensor`` rules: zeros when new or resized, moved when
           restored), then re-point every name at its view. Buffers sharing a name are dropped.

        Returns:
            ``(flat, views)``: the contiguous buffer and one flat view per name.
        """
        ck = (key, names)
        buf = self._flats.get(ck)
        # Step 1: reuse when every entry still points into the buffer at its offset.
        if buf is not None and buf.dtype == dtype and buf.device == torch.device(device):
            views, at, base, size = [], 0, buf.data_ptr(), buf.element_size()
            for name, n in zip(names, numels):
                t = self.params.get(name, {}).get(key)
                if t is None or t.numel() != n or t.data_ptr() != base + at * size or t.dtype != dtype:
                    break
                views.append(t)
                at += n
            else:
                return buf, views
        # Step 2: build.
        parts = [self.tensor(name, key, n, dtype, device) for name, n in zip(names, numels)]
        buf = torch.cat(parts) if parts else torch.zeros(0, dtype=dtype, device=device)
        self._flats = {k: v for k, v in self._flats.items() if k[0] != key or not set(k[1]) & set(names)}
        self._flats[ck] = buf
        views = list(buf.split(list(numels)))
        for name, v in zip(names, views):
            self.params[name][key] = v
        return buf, views

    def set(self, name: str, key: str, value: torch.Tensor) -> None:
        self._lazy.get(name, {}).pop(key, None)
        self.params.setdefault(name, {})[key] = value

    def set_per_unit(self, names: list[str], key: str, values_U: torch.Tensor, unit_of: list[int]) -> None:
        """Record ``values_U[unit_of[i]]`` as ``names[i]``'s ``key`` without a tensor operation per name."""
        for name, j in zip(names, unit_of):
            self.params.setdefault(name, {}).pop(key, None)
            self._lazy.setdefault(name, {})[key] = (values_U, j)

    def get(self, name: str, key: str) -> torch.Tensor | None:
        lazy = self._lazy.get(name, {}).get(key)
        if lazy is not None:
            return lazy[0][lazy[1]]
        return self.params.get(name, {}).get(key)

    def rescale(self, factor: float,
                keys: tuple[str, ...] = ("residual", "momentum", "residual_scales", "owner_residual")) -> None:
        """Multiply the ``keys`` memories by ``factor`` in place (a loss-scale change; exact for powers of 2).
        A 4-bit residual scales with its blocks' min and max (``residual_scales``): its codes stay."""
        done = set()
        for (key, _), buf in self._flats.items():
            if key in keys:
                buf.mul_(factor)
                done.add(buf.data_ptr())
        for entry in self.params.values():
            for key, t in entry.items():
                if key in keys and not (t.numel() and _inside_any(t, done, self._flats)):
                    t.mul_(factor)

    def state_dict(self) -> dict:
        """A checkpointable copy: CPU tensors and plain values, no process group."""
        names = sorted(set(self.params) | set(self._lazy))
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "step": self.step,
            "params": {name: {k: self.get(name, k).detach().to("cpu", copy=True)
                              for k in sorted(set(self.params.get(name, {})) | set(self._lazy.get(name, {})))}
                       for name in names},
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
        self._flats, self._lazy = {}, {}


def _inside_any(t: torch.Tensor, bases: set[int], flats: dict) -> bool:
    """Whether ``t`` lies inside one of the flat buffers (already rescaled as a whole)."""
    p = t.data_ptr()
    return any(b.data_ptr() <= p < b.data_ptr() + b.numel() * b.element_size()
               for b in flats.values() if b.data_ptr() in bases)
