"""The sparsifier contract shared by ``natural``, ``dgc`` and ``none`` (GRACE's Compressor, ZEN paper §4).

A sparsifier turns a *group* of named gradient tensors (views into one flat bucket, in bucket order)
into what travels: a ``SparseGrad`` (or a dense tensor) over the **concatenation** of the group. The
Synchronizer maps that index space back to bucket offsets, so a sparsifier never sees bucket layout
and its memory is keyed by parameter name, never by bucket index (engines rebuild buckets).

Sparsifiers send nothing themselves; ``dgc`` may talk over a tensor-parallel group to agree on one
threshold per layer. Config dataclasses validate in ``__post_init__`` with errors of the form
``zen.<section>.<field> (<value>) must <rule>``; ``config_from_dict`` builds one from a plain dict.
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Sequence, TypeVar

import torch

from .._keys import unknown_keys_message
from ..core.types import SparseGrad, acc_dtype  # noqa: F401 (acc_dtype: part of this module's API)

@dataclass(frozen=True)
class NamedGrad:
    """One parameter's gradient: a view into the flat bucket, shaped like the parameter."""

    name: str
    grad: torch.Tensor


class Sparsifier(abc.ABC):
    """Select what a group of gradients sends; the ``kind`` in ``param_kinds`` that it serves.

    A sparsifier the Synchronizer routes parameters to is registered with
    ``registry.register_sparsifier`` and declares the class attributes below. The generic layers
    (the Synchronizer, the reducer, the engine adapters, ``ZenConfig``, the statistics) never name a
    kind: what differs between kinds, they ask of these attributes and class methods (``label``,
    ``resolve_defaults``, ``row_sparse``, ``once_per_step``, ``uses_tp_group``). The hooks after
    ``compress`` default to doing nothing.
    """

    kind: ClassVar[str]
    lossless: ClassVar[bool]
    bucket_mode: ClassVar[str] = "fused"
    """``"fused"``: ``compress`` gets every slice of this kind in a bucket, as flat views, and returns one
    SparseGrad over their concatenation (one scheme call). ``"per_slice"``: ``compress_each`` gets them
    shaped like their parameters and returns one SparseGrad per slice (row forms may differ)."""
    uses_tp_group: ClassVar[bool] = False
    """Whether ``compress`` talks over the tensor-parallel group (then every TP rank must route each
    parameter of the kind alike: the agreement compares their names)."""
    row_sparse: ClassVar[bool] = False
    """Whether its gradients are sparse by rows (embeddings: only the rows of the batch's tokens are
    non-zero), synchronized in row form. The reducer then counts their non-zero rows before and after
    the synchronization (``gamma_<kind>`` in the step statistics: the paper's densification γ), and
    splits such a parameter that is replicated across the tensor-parallel group by rows: each TP rank
    synchronizes its share, and the TP ranks exchange the non-zero rows of the results."""
    once_per_step: ClassVar[bool] = False
    """Whether ``compress`` must see each optimizer step's gradient once, whole (memory that advances
    per step, e.g. DGC's momentum correction): an engine that reduces every micro-batch (DeepSpeed
    ZeRO-2 with gradient accumulation) refuses the kind."""
    value_bits: int | None = None
    """Bits its values travel in when fewer than their dtype's (``SparseGrad.lowbit``; DGC's
    ``zen.dgc.value_bits``): the Synchronizer then requires a scheme that carries them. None: the dtype."""

    @classmethod
    def from_config(cls, config, *, state, dp_size: int) -> "Sparsifier":
        """The Synchronizer's constructor call: its ``zen.<kind>`` config, the shared ``SparsifierState``
        (memory keyed by parameter name, checkpointed with the engine) and the data-parallel size."""
        return cls(config)

    @classmethod
    def label(cls, config) -> str:
        """How the start-up line and the summary name this kind's parameters (default: the kind)."""
        return cls.kind

    @classmethod
    def resolve_defaults(cls, config, optimizer, *, quiet: bool = False) -> tuple:
        """Decide the section's fields left null until zen attaches to an engine, from the engine's
        ``optimizer`` (None when the caller has none); ``quiet``: log no warning (ranks other than 0).

        Returns:
            ``(config, note)``: the section (a copy when a field was decided) and what was decided and
            why, for the start-up line ("" for nothing). Default: the section as it is.
        """
        return config, ""

    @classmethod
    def claims(cls, param, config) -> bool:
        """Whether this (enabled) sparsifier takes the parameter described by ``param`` (a
        ``registry.ParamFacts``); the first by priority that claims it wins. Default: none."""
        return False

    @abc.abstractmethod
    def compress(self, grads: Sequence[NamedGrad], tp_comm=None) -> SparseGrad | torch.Tensor:
        """What this rank sends for ``grads``, indexed over their concatenation (in the given order).

        Args:
            grads: the group's gradients, in bucket order; all of one dtype and device.
            tp_comm: the tensor-parallel group, for sparsifiers that agree on a threshold across it.

        Returns:
            A SparseGrad whose ``dense_numel`` is the total numel of ``grads`` with values in their dtype,
            or a dense flat tensor of that size.
        """

    def compress_each(self, grads: Sequence[NamedGrad]) -> list[SparseGrad]:
        """``per_slice`` mode: one SparseGrad per gradient (default: ``compress`` of each alone)."""
        return [self.compress([g]) for g in grads]

    def after_sync(self, names: Sequence[str], outs: Sequence[torch.Tensor]) -> None:
        """Called with the synchronized result of this kind's slices (views into the output bucket, in
        bucket order; ``names`` their memory keys) before the bucket is handed back: e.g. a feedback that
        keeps an aggregate of the synchronized gradient updates it here. Must do the same on every rank. The Synchronizer calls it
        only where a class or instance overrides it (the views cost work per slice)."""

    def set_loss_scale(self, scale: float) -> None:
        """The loss scale the next gradients carry (fp16): memory at the old scale is rescaled."""

    def discard_step(self) -> None:
        """The current step overflowed somewhere and is skipped: ``end_step`` undoes its memory updates."""

    def end_step(self) -> None:
        """Called once per optimizer step, after every bucket of the step was synchronized."""

    def resumed(self, saved_config: dict | None, restored: bool) -> None:
        """Called after a checkpoint's state was loaded: ``saved_config`` is this kind's config as saved
        (``dataclasses.asdict``; None when the checkpoint had none), ``restored`` whether this rank's memory
        was restored (False on a resize). A sparsifier whose memory depends on its settings reconciles it here."""


C = TypeVar("C")


def config_from_dict(cls: type[C], values: "dict | C | None", section: str) -> C:
    """Build the config dataclass ``cls`` from a plain dict (JSON keys equal field names).

    Raises:
        ValueError: an unknown key (the valid ones are listed).
        TypeError: ``values`` is neither a dict nor a ``cls``.
    """
    if values is None:
        return cls()
    if isinstance(values, cls):
        return values
    if not isinstance(values, dict):
        raise TypeError(f"zen.{section} must be a dict or {cls.__name__}, got {type(values).__name__}")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ValueError(unknown_keys_message(f"zen.{section}", unknown, names))
    return cls(**values)


def check_bool(section: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"zen.{section}.{name} ({value!r}) must be a bool")


def check_number(section: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"zen.{section}.{name} ({value!r}) must be a number")


def check_int(section: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"zen.{section}.{name} ({value!r}) must be an int")


def check_choice(section: str, name: str, value, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"zen.{section}.{name} ({value!r}) must be one of {list(choices)}")


