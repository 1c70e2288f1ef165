"""Communicators: the protocol, torch.distributed, and the in-process simulator."""

from .base import CommStats, Communicator
from .simulated import SimCommunicator, SimWorld

__all__ = ["CommStats", "Communicator", "SimCommunicator", "SimWorld", "TorchCommunicator"]


def __getattr__(name):
    # torch.distributed is imported lazily so that `import zen_ext.comm` stays cheap.
    if name == "TorchCommunicator":
        from .torch_dist import TorchCommunicator

        return TorchCommunicator
    raise AttributeError(name)
