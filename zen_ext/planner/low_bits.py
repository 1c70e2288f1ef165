"""``auto`` under ``zen.dgc.value_bits`` (``core/lowbit.py``): it chooses only among the candidates that carry
low-bit values, and its cost model predicts their bytes with the values' bits for the gradients that carry
them (``ZenScheme.predict_traffic`` with ``value_bits``); every other gradient is predicted as always."""

from __future__ import annotations

from ..core.registry import scheme_class
from ..core.scheme import low_bits_error
from ..core.types import SparseGrad


def narrow_to_low_bits(auto, bits: int, carriers: list[str] | None = None) -> None:
    """Keep ``auto``'s candidates that carry low-bit values; raise (naming ``carriers``) when none does."""
    keep = tuple(c for c in auto.candidates if scheme_class(c).carries_low_bits)
    if not keep:
        raise ValueError(low_bits_error(bits, f"zen.scheme 'auto' with zen.candidates {list(auto.candidates)}",
                                        carriers))
    auto.candidates = keep
    auto._schemes = {c: auto._schemes[c] for c in keep}
    auto._low_bits = {"value_bits": int(bits)}
    auto.carries_low_bits = True  # its sync_group's check passes the gradients on to the chosen carrier


def low_bit_options(auto, c: str, grad) -> dict:
    """Candidate ``c``'s cost-model options for ``grad``: its own, plus ``value_bits`` where ``grad`` carries it."""
    opts = auto._schemes[c].options()
    if auto._low_bits and isinstance(grad, SparseGrad) and grad.lowbit is not None:
        opts = {**opts, **auto._low_bits}
    return opts
