"""The ``zen.outer`` section: local steps, then a sparse outer synchronization (``outer/sync.py``).

Defaults are SparseLoCo's (arXiv 2508.15706, 512M sweep): H = 15 inner steps, error feedback β = 0.95,
top-64 of every 4,096-element chunk (1.5625 %), each index averaged over the replicas that sent it,
outer SGD lr 1 without momentum. ``density: 1`` with ``lr: 0.7, momentum: 0.9, nesterov: true`` is
DiLoCo (arXiv 2311.08105) as torchft ships it (a dense outer all-reduce of the pseudo-gradients).

Plain dataclass with its own checks (as ``zen.spardl``): errors read ``zen.outer.<field> (<value>)
must <rule>``. Engine-neutral: imports nothing but the standard library and ``zen_ext._keys``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .._keys import unknown_keys_message

AVERAGES = ("mean", "contributors")
STATE_DEVICES = ("cpu", "device")
VALUE_BITS = (8, 4)
"""``value_bits``' values (``core/lowbit.py``'s: ZEN's low-bit wire)."""
DELAYS = (0, 1)
"""Supported ``delay`` values: 0 (the outer update applied at once) or 1 (Streaming DiLoCo's overlap: the
sum of round t runs while round t + 1 trains and is applied at the next outer step, ``outer/sync.py``)."""

_PATH = "zen.outer"


@dataclass(kw_only=True)
class OuterConfig:
    """Local steps and a sparse outer synchronization every ``every`` steps (``zen_ext/outer/``); off
    unless ``enabled``. With it on, inner steps synchronize nothing."""

    enabled: bool = False
    """Train with local steps and an outer synchronization instead of a per-step gradient sync. Default false."""
    every: int = 15
    """H: inner optimizer steps between outer steps, >= 1. Default 15 (SparseLoCo's 512M sweep; DiLoCo used 500)."""
    density: float = 0.015625
    """Fraction of each chunk's entries a replica sends, in (0, 1]: k = max(1, round(density·chunk)) per
    chunk. Default 64/4096 (SparseLoCo). 1 sends the whole pseudo-gradient with a dense all-reduce
    (dense DiLoCo; no error feedback is kept)."""
    error_decay: float = 0.95
    """β of the error feedback e ← β·e + Δ, in [0, 1]. Default 0.95 (SparseLoCo)."""
    chunk: int = 4096
    """Elements per top-k chunk of the flat parameter vector, >= 1. Default 4096 (SparseLoCo's 64×64 tiles;
    here consecutive elements of each bucket, so a chunk may straddle two parameters)."""
    lr: float = 1.0
    """Outer SGD learning rate, > 0. Default 1 (SparseLoCo); DiLoCo: 0.7."""
    momentum: float = 0.0
    """Outer SGD momentum, in [0, 1). Default 0 (SparseLoCo); DiLoCo: 0.9."""
    nesterov: bool = False
    """Nesterov momentum (needs momentum > 0). Default false (SparseLoCo); DiLoCo: true."""
    average: str = "contributors"
    """How the summed pseudo-gradient is averaged: ``"contributors"`` (each index divided by the number of
    replicas that sent it, SparseLoCo's ``scatter_reduce_(reduce="mean")``) or ``"mean"`` (divided by the
    number of replicas, DiLoCo). Default contributors."""
    state_device: str = "cpu"
    """Where θ_global, the error feedback and the outer momentum live: ``"cpu"`` (as SparseLoCo keeps
    them) or ``"device"`` (the parameters' device). Default cpu."""
    delay: int = 0
    """Rounds the outer update is applied late: 0 (applied at once, every replica restarts from θ_global)
    or 1 (Streaming DiLoCo's overlap: the sum of round t runs on a communication thread while round t + 1
    trains and is merged into each replica at the next outer step; call ``finish()`` at the end of
    training). Default 0."""
    value_bits: int | None = None
    """Bits per picked value on the wire: 8 or 4 (block-quantized, a scale per 128 values, fp32 or bf16; what
    quantization loses stays in the error feedback), or unset: fp32. ZEN schemes only (``zen``,
    ``zen_coo``), density < 1. Default unset (SparseLoCo sends 2-bit values)."""

    def __post_init__(self) -> None:
        for name in ("enabled", "nesterov"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{_PATH}.{name} ({getattr(self, name)!r}) must be a bool (true or false)")
        for name in ("every", "chunk", "delay"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{_PATH}.{name} ({v!r}) must be an integer")
        for name in ("density", "error_decay", "lr", "momentum"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"{_PATH}.{name} ({v!r}) must be a number")
            if not math.isfinite(v):
                raise ValueError(f"{_PATH}.{name} ({v!r}) must be a finite number")
        for name in ("average", "state_device"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{_PATH}.{name} ({getattr(self, name)!r}) must be a string")
        if self.every < 1:
            raise ValueError(f"{_PATH}.every ({self.every!r}) must be >= 1")
        if not 0 < self.density <= 1:
            raise ValueError(f"{_PATH}.density ({self.density!r}) must be in (0, 1]")
        if not 0 <= self.error_decay <= 1:
            raise ValueError(f"{_PATH}.error_decay ({self.error_decay!r}) must be in [0, 1]")
        if self.chunk < 1:
            raise ValueError(f"{_PATH}.chunk ({self.chunk!r}) must be >= 1")
        if not self.lr > 0:
            raise ValueError(f"{_PATH}.lr ({self.lr!r}) must be > 0")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"{_PATH}.momentum ({self.momentum!r}) must be in [0, 1)")
        if self.nesterov and self.momentum == 0:
            raise ValueError(f"{_PATH}.nesterov ({self.nesterov!r}) must be false when zen.outer.momentum is 0 "
                             f"(Nesterov needs momentum, as torch.optim.SGD)")
        if self.average not in AVERAGES:
            raise ValueError(f"{_PATH}.average ({self.average!r}) must be one of {list(AVERAGES)}")
        if self.state_device not in STATE_DEVICES:
            raise ValueError(f"{_PATH}.state_device ({self.state_device!r}) must be one of {list(STATE_DEVICES)}")
        if self.delay not in DELAYS:
            raise ValueError(f"{_PATH}.delay ({self.delay!r}) must be 0 or 1")
        if self.value_bits is not None:
            if isinstance(self.value_bits, bool) or self.value_bits not in VALUE_BITS:
                raise ValueError(f"{_PATH}.value_bits ({self.value_bits!r}) must be one of {list(VALUE_BITS)} or unset")
            if self.dense:
                raise ValueError(f"{_PATH}.value_bits ({self.value_bits!r}) must be unset with {_PATH}.density 1 "
                                 f"(the dense all-reduce carries fp32 values)")
        for name in ("density", "error_decay", "lr", "momentum"):  # ints accepted in JSON, floats kept
            setattr(self, name, float(getattr(self, name)))

    @classmethod
    def from_dict(cls, values: "dict | OuterConfig | None") -> "OuterConfig":
        """The section from a plain dict (None: the defaults); an unknown key raises ValueError listing the
        valid ones, as every section does."""
        if values is None or isinstance(values, cls):
            return values or cls()
        if not isinstance(values, dict):
            raise TypeError(f"{_PATH} ({values!r}) must be a JSON object (dict)")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = set(values) - set(names)
        if unknown:
            raise ValueError(unknown_keys_message(_PATH, unknown, names))
        return cls(**values)

    @property
    def dense(self) -> bool:
        """Whether every entry is sent (density 1: dense DiLoCo, no error feedback kept)."""
        return self.density >= 1.0

    def k_of(self, length: int) -> int:
        """Entries picked from a chunk of ``length`` elements: ``max(1, round(density·length))``, at most ``length``."""
        return min(length, max(1, round(self.density * length)))
