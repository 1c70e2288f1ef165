"""The reduce-scatter registry: name → ``ReduceScatterScheme`` class (``build_reduce_scatter``).

The built-in reduce-scatter schemes are the explicit list ``BUILTIN_REDUCE_SCATTERS`` below: adding one
is its own module (``core/rs_<name>.py``: its reduce-scatter and its byte predictor), one line here,
and its tests. The protocol they implement is ``core/rs_base.py``; the contract ``docs/reduce_scatter.md``.
"""

from __future__ import annotations

import inspect

from .registry import available_schemes, scheme_class
from .rs_auto import AutoReduceScatter
from .rs_base import ReduceScatterScheme
from .rs_dense import DenseReduceScatter
from .rs_direct import DirectReduceScatter
from .rs_spardl import SparDLReduceScatter
from .rs_zen import ZenReduceScatter

BUILTIN_REDUCE_SCATTERS: tuple[type[ReduceScatterScheme], ...] = (
    DenseReduceScatter, DirectReduceScatter, ZenReduceScatter, AutoReduceScatter, SparDLReduceScatter)
"""Core's reduce-scatter schemes (``dense`` is the oracle every lossless one must equal)."""

_REGISTRY: dict[str, type[ReduceScatterScheme]] = {}


def register_reduce_scatter(cls: type[ReduceScatterScheme]) -> type[ReduceScatterScheme]:
    """Class decorator: make ``cls`` buildable as ``build_reduce_scatter(cls.name)``."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"reduce-scatter name {cls.name!r} is already registered by {_REGISTRY[cls.name].__name__}")
    _REGISTRY[cls.name] = cls
    return cls


def available_reduce_scatters() -> list[str]:
    return sorted(_REGISTRY)


def low_bit_reduce_scatters() -> list[str]:
    """The registered reduce-scatter schemes that carry ``zen.dgc.value_bits`` (``carries_low_bits``)."""
    return [name for name, cls in _REGISTRY.items() if cls.carries_low_bits]


def build_reduce_scatter(name: str, **options) -> ReduceScatterScheme:
    """Build a registered reduce-scatter scheme by name.

    Raises:
        ValueError: unknown name or option (lists the valid ones).
    """
    if name not in _REGISTRY:
        raise ValueError(f"zen.reduce_scatter ({name!r}) must be one of {sorted(_REGISTRY)}")
    cls = _REGISTRY[name]
    valid = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "args", "kwargs")]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"reduce-scatter {name!r} got unknown option(s) {unknown}; valid options are {sorted(valid)}")
    return cls(**options)


def reduce_scatter_for(scheme: str) -> str:
    """The reduce-scatter scheme that serves ``zen.scheme`` under ZeRO-2/3 or FSDP2: the scheme class's
    ``reduce_scatter_form`` (``zen``/``zen_coo`` → zen, ``dense`` → dense, ``auto`` → auto).

    Raises:
        NotImplementedError: an all-reduce baseline without a reduce-scatter form (names the supported).
    """
    form = scheme_class(scheme).reduce_scatter_form
    if form is None:
        supported = sorted(n for n in available_schemes() if scheme_class(n).reduce_scatter_form is not None)
        raise NotImplementedError(f"zen.scheme ({scheme!r}) has no reduce-scatter form for sharded training "
                                  f"(ZeRO-2 reduce_scatter, ZeRO-3, FSDP2); supported: {supported}")
    return form


def reduce_scatter_of(scheme) -> ReduceScatterScheme:
    """The reduce-scatter form of an all-reduce SyncScheme (``reduce_scatter_for`` its name), built with
    the options both take (``zen``: seed, hash parameters; ``zen_coo``: its COO pull)."""
    name = reduce_scatter_for(scheme.name)
    accepted = set(inspect.signature(_REGISTRY[name].__init__).parameters) - {"self"}
    return build_reduce_scatter(name, **{k: v for k, v in scheme.options().items() if k in accepted})


for _cls in BUILTIN_REDUCE_SCATTERS:
    register_reduce_scatter(_cls)
