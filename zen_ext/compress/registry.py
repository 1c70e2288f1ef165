"""The sparsifier registry: every kind a parameter can be routed to, and the facts about each.

A sparsifier class declares, next to its code:

* ``kind`` — its name in ``param_kinds``, in stats and in the config (the ``zen.<kind>`` section);
* ``lossless`` — whether the synchronized result equals a dense all-reduce of the same inputs;
* ``bucket_mode`` — how it plugs into a bucket: ``"per_slice"`` (one SparseGrad per parameter, shaped
  views: natural's rows) or ``"fused"`` (one SparseGrad over the concatenation of every slice of its
  kind in the bucket, flat views: DGC);
* ``claims(param, config)`` — whether it takes a parameter (the classification hook);

* the hooks the generic layers ask instead of naming a kind (``Sparsifier.label``,
  ``resolve_defaults``, ``row_sparse``, ``once_per_step``, ``uses_tp_group``: ``base.py``);

and ``@register_sparsifier(config=..., priority=...)`` names its config dataclass (a ``zen.<kind>``
section with an ``enabled`` field) and where it stands in the classification order: parameters go to
the first enabled sparsifier, by ascending priority, that claims them, and to ``"dense"`` (the
all-reduce; not a registered kind) when none does. The built-ins register when ``zen_ext.compress``
is imported (its ``__init__.py`` imports them; that import list is the list of built-ins):
``natural`` (priority 100), ``dgc`` (200); a sparsifier registered from outside defaults to priority 0,
so it sees every parameter first.

The Synchronizer, ``classify_parameters``, the cross-rank agreement, the reducer's row statistics,
the engine adapters and ``ZenConfig`` (one ``zen.<kind>`` section per registered kind) read this
registry and those hooks; the modules of ``zen_ext.reduction``, ``zen_ext.engines`` and
``zen_ext/config.py`` name no kind (tests/unit/test_sparsifier_hooks.py checks it). docs/extending.md has a
worked example.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from .base import Sparsifier, config_from_dict

log = logging.getLogger(__name__)

DENSE = "dense"
"""The kind of parameters no sparsifier claims: reduced by one dense all-reduce per bucket."""
BUCKET_MODES = ("per_slice", "fused")


@dataclass(frozen=True)
class SparsifierSpec:
    """One registered sparsifier: its class, its config dataclass and its classification priority."""

    kind: str
    cls: type
    config: type
    priority: int

    def parse(self, values) -> Any:
        """The ``zen.<kind>`` section as the config dataclass (a dict, an instance, or None = defaults)."""
        from_dict = getattr(self.config, "from_dict", None)
        return from_dict(values) if from_dict is not None else config_from_dict(self.config, values, self.kind)

    def disabled(self) -> Any:
        """The config with ``enabled=False``: a kind the Synchronizer was given no section for."""
        return dataclasses.replace(self.parse(None), enabled=False)


_REGISTRY: dict[str, SparsifierSpec] = {}


def register_sparsifier(*, config: type, priority: int = 0):
    """Class decorator: register a ``Sparsifier`` subclass under its ``kind``.

    Args:
        config: the dataclass of its ``zen.<kind>`` section: every field has a default, and a bool field
            ``enabled``. A ``ZenConfig`` without the section holds the defaults (so an opt-in kind
            defaults ``enabled`` to false); the Synchronizer and ``classify_parameters`` treat a kind
            they are given no section for as disabled.
        priority: classification order (lower first); the built-ins use 100 and 200.

    Raises:
        TypeError: the class is not a Sparsifier, or ``config`` is not a dataclass with ``enabled``.
        ValueError: the kind is missing, reserved (``"dense"``), taken by another class, or the
            class's ``bucket_mode`` is not one of ``BUCKET_MODES``.
    """

    def wrap(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, Sparsifier)):
            raise TypeError(f"register_sparsifier ({cls!r}) must decorate a Sparsifier subclass")
        kind = getattr(cls, "kind", None)
        if not isinstance(kind, str) or not kind.isidentifier() or kind == DENSE:
            raise ValueError(f"{cls.__name__}.kind ({kind!r}) must be an identifier other than {DENSE!r}")
        if cls.bucket_mode not in BUCKET_MODES:
            raise ValueError(f"{cls.__name__}.bucket_mode ({cls.bucket_mode!r}) must be one of {list(BUCKET_MODES)}")
        if not dataclasses.is_dataclass(config) or "enabled" not in {f.name for f in dataclasses.fields(config)}:
            raise TypeError(f"register_sparsifier config ({config!r}) must be a dataclass with a bool field 'enabled'")
        old = _REGISTRY.get(kind)
        if old is not None and old.cls.__qualname__ != cls.__qualname__:
            raise ValueError(f"sparsifier kind ({kind!r}) must be unique: {old.cls.__name__} already has it")
        _REGISTRY[kind] = SparsifierSpec(kind, cls, config, int(priority))
        return cls

    return wrap


def unregister_sparsifier(kind: str) -> None:
    """Remove a kind registered from outside (tests, plugins that unload); built-ins stay."""
    spec = _REGISTRY.get(kind)
    if spec is not None and is_builtin(spec):
        raise ValueError(f"sparsifier kind ({kind!r}) must not be a built-in to unregister")
    _REGISTRY.pop(kind, None)


def is_builtin(spec: SparsifierSpec) -> bool:
    """Whether ``spec`` is one of the package's own sparsifiers (defined under ``zen_ext.compress``)."""
    return spec.cls.__module__.startswith(__package__ + ".")


def registered() -> list[SparsifierSpec]:
    """Every registered sparsifier by ascending priority (ties by kind): the classification order, and
    the order in which a bucket's kinds are compressed and handed to the scheme."""
    return sorted(_REGISTRY.values(), key=lambda s: (s.priority, s.kind))


def spec_of(kind: str) -> SparsifierSpec:
    """The registered sparsifier ``kind``.

    Raises:
        ValueError: no sparsifier has that kind (the registered ones are listed).
    """
    specs = {s.kind: s for s in registered()}
    if kind not in specs:
        raise ValueError(f"sparsifier kind ({kind!r}) must be one of {sorted(specs)} (or {DENSE!r})")
    return specs[kind]


def all_kinds() -> tuple[str, ...]:
    """Every value ``param_kinds`` may hold: the registered kinds and ``"dense"``."""
    return tuple(s.kind for s in registered()) + (DENSE,)


@dataclass(frozen=True)
class ParamFacts:
    """What classification knows about one trainable parameter (gathered once per model)."""

    name: str
    """``named_parameters()`` name."""
    dim: int
    numel: int
    """The largest shard any tensor-parallel rank holds (the local numel without TP): the same on every
    TP rank, so every rank routes the parameter alike."""
    is_embedding: bool
    tied: bool
    """An embedding weight that is also an output layer's (its gradient is dense)."""
