"""Sparsifiers: DGC top-k (lossy, with memory), natural embedding rows (lossless), none (dense).

Engine-free: imports only ``zen_ext.core`` types. The Synchronizer (``zen_ext.reduction.synchronizer``)
routes each parameter to one of them by the kind ``classify_parameters`` gives it.
"""

from .base import KINDS, NamedGrad, Sparsifier
from .dgc import DGCConfig, DGCSparsifier
from .natural import NaturalConfig, NaturalSparsifier, classify_parameters
from .none import NoneSparsifier
from .state import SparsifierState

__all__ = [
    "KINDS", "DGCConfig", "DGCSparsifier", "NamedGrad", "NaturalConfig", "NaturalSparsifier", "NoneSparsifier",
    "Sparsifier", "SparsifierState", "classify_parameters",
]
