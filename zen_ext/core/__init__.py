"""Engine-free core: gradient types, hashing, encodings, schemes and their registry. It imports neither
the sparsifiers (``zen_ext.compress``) nor the reduction layer (``zen_ext.reduction``), which build on it."""

from .scheme import SyncScheme, available_schemes, build_scheme, register_scheme
from .types import SparseGrad

__all__ = ["SparseGrad", "SyncScheme", "available_schemes", "build_scheme", "register_scheme"]
