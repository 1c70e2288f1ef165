"""Sparsifiers: DGC top-k (lossy, with memory), natural embedding rows (lossless), none (dense).

Engine-free: imports only ``zen_ext.core`` types. Each sparsifier registers itself
(``registry.register_sparsifier``) when its module is imported, and the imports below are the list of
built-ins: importing any module of this package registers them. ``classify_parameters``
(``routing.py``) gives each parameter a kind, and the Synchronizer (``zen_ext.reduction.synchronizer``)
loops over the registered kinds. Adding one: docs/extending.md.
"""

from .base import NamedGrad, Sparsifier
from .dgc import DGCConfig, DGCSparsifier
from .natural import NaturalConfig, NaturalSparsifier
from .none import NoneSparsifier
from .registry import ParamFacts, all_kinds, register_sparsifier, registered, spec_of, unregister_sparsifier
from .routing import classify_parameters
from .state import SparsifierState

__all__ = [
    "DGCConfig", "DGCSparsifier", "NamedGrad", "NaturalConfig", "NaturalSparsifier", "NoneSparsifier",
    "ParamFacts", "Sparsifier", "SparsifierState", "all_kinds", "classify_parameters", "register_sparsifier",
    "registered", "spec_of", "unregister_sparsifier",
]
