"""Engine-free core: gradient types, hashing, encodings, schemes and their registry."""

from .scheme import SyncScheme, available_schemes, build_scheme, register_scheme
from .types import SparseGrad

__all__ = ["SparseGrad", "SyncScheme", "available_schemes", "build_scheme", "register_scheme"]
