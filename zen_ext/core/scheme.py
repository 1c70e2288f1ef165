"""The SyncScheme protocol and the name → class registry (``build_scheme``).

A scheme synchronizes one flat gradient over a Communicator and returns the dense aggregate on every
rank. Lossless schemes must equal ``dense`` (an all-reduce of the same inputs) up to float summation
order. Options are keyword arguments of the scheme's constructor.
"""

from __future__ import annotations

import abc
import inspect
from typing import ClassVar

import torch

from ..comm.base import Communicator
from .types import SparseGrad

REDUCE_OPS = ("sum", "mean")
_REGISTRY: dict[str, type["SyncScheme"]] = {}


class SyncScheme(abc.ABC):
    """One way to aggregate a (sparse) gradient across the ranks of a Communicator."""

    name: ClassVar[str]
    lossless: ClassVar[bool] = True

    @abc.abstractmethod
    def sync(
        self, comm: Communicator, grad: SparseGrad | torch.Tensor, op: str = "sum", timings: dict | None = None,
        key: str | None = None,
    ) -> torch.Tensor:
        """Aggregate ``grad`` over ``comm``; returns a dense flat tensor of ``grad``'s numel and dtype.

        Args:
            comm: the ranks to synchronize.
            grad: this rank's gradient, sparse (COO) or dense.
            op: ``"sum"`` or ``"mean"``.
            timings: if given, filled with seconds per phase.
            key: a stable name of the gradient slice (e.g. a parameter or bucket name); schemes that
                keep per-slice decisions (``auto``) use it, the others ignore it.
        """

    def options(self) -> dict:
        """The constructor options this instance was built with (for agreement checks and logs)."""
        return {}

    def check_agreement(self, comm: Communicator) -> None:
        """Raise RuntimeError unless every rank of ``comm`` built this scheme with the same options.

        A scheme's options (seed, formats) shape its collectives: ranks that disagree would exchange
        garbage or hang, so they are compared explicitly once, before the first sync.
        """
        mine = (self.name, sorted(self.options().items()))
        for rank, theirs in enumerate(comm.all_gather_object(mine)):
            if theirs != mine:
                raise RuntimeError(
                    f"scheme configuration differs across ranks: rank {comm.rank} has {mine}, rank {rank} has {theirs}"
                )

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{type(self).__name__}({opts})"


def check_op(op: str) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"op ({op!r}) must be one of {list(REDUCE_OPS)}")


def register_scheme(cls: type[SyncScheme]) -> type[SyncScheme]:
    """Class decorator: make ``cls`` buildable as ``build_scheme(cls.name)``."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"scheme name {cls.name!r} is already registered by {_REGISTRY[cls.name].__name__}")
    _REGISTRY[cls.name] = cls
    return cls


def available_schemes() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def build_scheme(name: str, **options) -> SyncScheme:
    """Build a registered scheme by name.

    Raises:
        ValueError: unknown name (lists the valid ones) or an unknown option (lists the valid ones).
    """
    _load_builtin()
    if name not in _REGISTRY:
        raise ValueError(f"zen.scheme ({name!r}) must be one of {sorted(_REGISTRY)}")
    cls = _REGISTRY[name]
    valid = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"scheme {name!r} got unknown option(s) {unknown}; valid options are {sorted(valid)}")
    return cls(**options)


# Modules whose import registers built-in schemes (a module not written yet is skipped).
_BUILTIN_MODULES = (
    "zen_ext.core.dense",
    "zen_ext.core.zen",
    "zen_ext.core.agsparse",
    "zen_ext.core.sparcml",
    "zen_ext.core.omnireduce",
    "zen_ext.core.sparse_ps",
    "zen_ext.analysis.planner",
)


def _load_builtin() -> None:
    import importlib

    for mod in _BUILTIN_MODULES:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            if exc.name != mod:
                raise
