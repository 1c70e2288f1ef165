"""The outer sum and its average (``OuterSync`` step 3-4): how the picks of every replica travel through the
scheme, and in which bits.

Three forms, chosen once per ``OuterSync`` (``plan``), the same on every replica (the config and the
scheme are compared across replicas before any outer step):

* ``"mean"`` (``average: "mean"``): the picks as one value each, summed (``op="sum"``), divided by R.
* ``"counted"`` (``average: "contributors"`` with a scheme that counts, ZEN's): ``op="contributors"``;
  the owners count the senders of every position they own and divide there (``core/zen_count.py``), so
  the pull carries averages in the bytes of ``"mean"``.
* ``"rows"`` (``average: "contributors"`` with any other lossless scheme): each pick a row ``(value, 1)``
  through a plain sum, which also counts the senders; twice the values on the wire. Logged once.

With ``value_bits`` (8 or 4; ZEN schemes only) the picks travel as block-quantized codes
(``core/lowbit.py``: symmetric, a scale per ``OUTER_VALUE_BLOCK`` = 128 values at both widths, fp32 at 8
bits and bf16 at 4 as every 4-bit value's, where the per-step DGC path uses 16 at 4 bits: 128 is the block
the outer's bytes and quality were measured with (with fp32 scales: bf16 ones since cut the 4-bit picks'
bytes by about 0.3 %), and 16 was chosen on per-step DGC values from random weights, not measured on
pseudo-gradients). What the
owners receive is the dequantized
pick; the difference goes back into the replica's outer error feedback (``LowBitValues.sender_feedback``),
so quantization delays a value to a later outer step, never drops it (SparseLoCo's rule for its 2-bit
values). No owner residual: an owner's pull quantizes the averaged sum once more, and that error is
applied to θ_global identically on every replica (one message, decoded by all) — SparseLoCo's
all-gather has no second quantization, so this is ZEN's extra error, bounded per value by half a
quantization step of its block; a residual of an average over a varying number of senders would have to
be kept per owned position (``P/R`` fp32 a rank) with no clear meaning in the next round's sum.

Legend: ``_N`` elements of a bucket, ``_K`` picks.
"""

from __future__ import annotations

import logging

import torch

from ..comm.base import Communicator
from ..core.lowbit import LowBitValues
from ..core.scheme import SyncScheme
from ..core.types import SparseGrad
from ..core.zen_count import CONTRIBUTORS
from .config import OuterConfig

log = logging.getLogger(__name__)

OUTER_VALUE_BLOCK = 128
"""Values per scale of the outer's low-bit picks, at 8 and 4 bits (module docstring: why not 16)."""
FORMS = ("mean", "counted", "rows")


def plan(cfg: OuterConfig, scheme: SyncScheme) -> str:
    """The form (module docstring) for ``cfg`` and ``scheme``; refuses ``value_bits`` with a scheme that
    cannot carry them.

    Raises:
        ValueError: ``value_bits`` set with a scheme that does not carry low-bit values or does not count
            the senders (``"contributors"``: the row form has no low-bit path).
    """
    counts = bool(getattr(scheme, "counts_contributors", False))
    if cfg.value_bits is not None and not (getattr(scheme, "carries_low_bits", False) and
                                           (counts or cfg.average == "mean")):
        raise ValueError(f"zen.outer.value_bits ({cfg.value_bits}) must be unset with zen.scheme ({scheme.name!r}): "
                         f"only ZEN schemes carry the outer picks in low bits (zen, zen_coo)")
    if cfg.dense or cfg.average == "mean":
        return "mean"
    if counts:
        return "counted"
    log.info("zen.outer: zen.scheme %r does not count the senders of each index; average 'contributors' "
             "sends each pick as a (value, 1) row (twice the values on the wire; ZEN counts at its owners)",
             scheme.name)
    return "rows"


def sum_average(comm: Communicator, scheme: SyncScheme, form: str, key: str, numel: int, idx_K: torch.Tensor,
                val_K: torch.Tensor, err_N: torch.Tensor, value_bits: int | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The replicas' picks summed and averaged (on the communicator's device).

    1. Build the SparseGrad of the form: one value per pick, or ``(value, 1)`` rows; with ``value_bits``
       its ``LowBitValues``, whose sender feedback puts ``pick − dequantized`` back into ``err_N``.
    2. One ``sync_group`` call of the scheme (``op="contributors"`` in the counted form).
    3. Average: ``/R`` (mean), ``/count`` where count > 0 (rows), nothing more (counted: done by the owners).

    Returns:
        ``(avg_N, union_1)``: ``union_1`` (a 1-element tensor) counts the indices some replica sent (rows:
        exact) or the non-zero averages (counted: the union unless a sum cancelled to exactly 0 or a
        low-bit average rounded to 0); None in the mean form.
    """
    dev = comm.device
    # Step 1: the SparseGrad.
    vals = torch.stack([val_K, torch.ones_like(val_K)], dim=1) if form == "rows" else val_K
    lowbit = None
    if value_bits is not None:
        idx_dev = idx_K.to(dev)

        def feedback(order_K: torch.Tensor, deq_K: torch.Tensor) -> None:
            # What the owners will see of pick j is deq; the rest stays in this replica's error feedback.
            at = idx_dev.index_select(0, order_K)
            lost = val_K.to(dev).index_select(0, order_K) - deq_K.to(val_K.dtype)
            err_N.index_add_(0, at.to(err_N.device), lost.to(err_N.device))

        lowbit = LowBitValues(bits=value_bits, block=OUTER_VALUE_BLOCK, sender_feedback=feedback)
    grad = SparseGrad(idx_K.to(dev), vals.to(dev), numel, in_range=True, lowbit=lowbit)
    # Step 2: the sum.
    with comm.slot(("outer", key)):
        (res,) = scheme.sync_group(comm, [grad], CONTRIBUTORS if form == "counted" else "sum", keys=[f"outer/{key}"])
    # Step 3: the average.
    if form == "mean":
        return res.div_(comm.size), None
    if form == "counted":
        return res, res.ne(0).sum().reshape(1)
    res_N2 = res.view(numel, 2)
    count_N = res_N2[:, 1]
    return res_N2[:, 0].div(count_N.clamp(min=1)), count_N.gt(0).sum().reshape(1)
