"""zen_ext: ZEN sparse gradient synchronization (OSDI'25) for DeepSpeed and ColossalAI."""

from .comm import CommStats, Communicator, SimWorld
from .core import SparseGrad, available_schemes, build_scheme

__version__ = "0.1.0"
__all__ = ["CommStats", "Communicator", "SimWorld", "SparseGrad", "available_schemes", "build_scheme", "__version__"]
