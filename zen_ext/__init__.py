"""zen_ext: ZEN sparse gradient synchronization (OSDI'25) for DeepSpeed and ColossalAI."""

from .comm import CommStats, Communicator, SimWorld
from .core import SparseGrad, available_schemes, build_scheme
# Registers the "auto" scheme: it lives with the planner, and core (which holds the registry) never
# imports the planner.
from .planner import auto as _auto  # noqa: F401

__version__ = "0.1.0"
__all__ = ["CommStats", "Communicator", "GradSlice", "SimWorld", "SparseGrad", "Synchronizer", "available_schemes",
           "build_scheme", "__version__"]


def __getattr__(name):
    # The synchronizer pulls in the sparsifiers: imported on first use to keep `import zen_ext` light.
    if name == "Synchronizer":
        from .reduction.synchronizer import Synchronizer

        return Synchronizer
    if name == "GradSlice":
        from .reduction.plan import GradSlice

        return GradSlice
    raise AttributeError(f"module 'zen_ext' has no attribute {name!r}")
