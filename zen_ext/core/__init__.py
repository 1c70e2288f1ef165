"""Engine-free core: gradient types, hashing, encodings, schemes (each with its cost model) and their
registry. It imports neither the sparsifiers (``zen_ext.compress``) nor the reduction layer
(``zen_ext.reduction``) nor the planner (``zen_ext.planner``), which build on it."""

from .registry import available_schemes, build_scheme, register_scheme
from .scheme import SyncScheme
from .types import SparseGrad

__all__ = ["SparseGrad", "SyncScheme", "available_schemes", "build_scheme", "register_scheme"]
