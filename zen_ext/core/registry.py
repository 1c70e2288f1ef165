"""The scheme registry: name → ``SyncScheme`` class (``build_scheme``, ``zen.scheme``).

The built-in schemes of core are the explicit list ``BUILTIN_SCHEMES`` below: adding one is its own
module (its sync and its cost model, ``core/scheme.py``), one line here, and its tests. Schemes of a
higher layer and outside schemes register themselves with ``register_scheme`` when their module is
imported: the planner's ``auto`` does (``zen_ext/planner/auto.py``; ``zen_ext/__init__.py`` imports it,
so every use of the package has it), so core never imports the planner.
"""

from __future__ import annotations

import inspect

from .agsparse import AGSparseScheme
from .dense import DenseScheme
from .omnireduce import OmniReduceScheme
from .scheme import SyncScheme
from .sparcml import SparCMLScheme
from .sparse_ps import SparsePSScheme
from .spardl import SparDLScheme
from .zen import ZenCooScheme, ZenScheme

BUILTIN_SCHEMES: tuple[type[SyncScheme], ...] = (
    DenseScheme, ZenScheme, SparCMLScheme, ZenCooScheme, AGSparseScheme, OmniReduceScheme, SparsePSScheme,
    SparDLScheme)
"""Core's schemes, in the order ``auto`` breaks exact ties in and tables list them: the simpler first,
the oracle (dense all-reduce: no profile makes it slower than itself) before all; the lossy ``spardl``
last (``auto`` never picks a lossy scheme)."""

_REGISTRY: dict[str, type[SyncScheme]] = {}


def register_scheme(cls: type[SyncScheme]) -> type[SyncScheme]:
    """Make ``cls`` buildable as ``build_scheme(cls.name)`` (usable as a class decorator).

    Raises:
        ValueError: the name is taken by another class, or ``cls`` declares ``wire_phases`` without
            overriding both ``predict_traffic`` and ``predict_work`` (a half-declared cost model).
    """
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"scheme name {cls.name!r} is already registered by {_REGISTRY[cls.name].__name__}")
    if cls.wire_phases:
        missing = [m for m in ("predict_traffic", "predict_work") if getattr(cls, m) is getattr(SyncScheme, m)]
        if missing:
            raise ValueError(f"scheme {cls.name!r} declares wire_phases {cls.wire_phases} but not {missing}; "
                             "declare the whole cost model or none (core/scheme.py)")
    _REGISTRY[cls.name] = cls
    return cls


def unregister_scheme(name: str) -> None:
    """Forget scheme ``name`` (tests that register a scheme of their own)."""
    _REGISTRY.pop(name, None)


def available_schemes() -> list[str]:
    """Every registered scheme name, sorted."""
    return sorted(_REGISTRY)


def registered_schemes() -> list[str]:
    """Every registered scheme name in registration order (``BUILTIN_SCHEMES`` first, in its order)."""
    return list(_REGISTRY)


def scheme_class(name: str) -> type[SyncScheme]:
    """The class registered as ``name``.

    Raises:
        ValueError: unknown name (lists the valid ones).
    """
    if name not in _REGISTRY:
        raise ValueError(f"zen.scheme ({name!r}) must be one of {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def build_scheme(name: str, **options) -> SyncScheme:
    """Build a registered scheme by name.

    Raises:
        ValueError: unknown name (lists the valid ones) or an unknown option (lists the valid ones).
    """
    cls = scheme_class(name)
    valid = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"scheme {name!r} got unknown option(s) {unknown}; valid options are {sorted(valid)}")
    return cls(**options)


for _cls in BUILTIN_SCHEMES:
    register_scheme(_cls)
