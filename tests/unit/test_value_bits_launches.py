"""``zen.dgc.value_bits``' fused ops are what the schemes dispatch (core/zen_lowbit.py, core/rs_zen.py): per
low-bit gradient one ``quantize_sent_`` (gather, quantize, DGC's sender feedback), one
``dequantize_add_blocks_`` (the owner's aggregation) and one ``quantize_owned_`` (the owner's residual and
quantize), whatever the number of ranks, and none of the ops they replaced (``index_add_`` of the sender's
feedback and of the owner's sum, ``where`` of the owner residual, ``quantize_blocks``; ``dequantize_blocks``
on the all-reduce, whose pull is decoded by ``decode_pulls_lowbit_``) runs beside them. (The DGC selection's
``index_fill_`` and the reduce-scatter's decode, ``dequantize_blocks`` and ``index_copy_``, are not theirs.)"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.unit.test_synchronizer import DGC, KINDS, SLICES, bucket_inputs
from zen_ext import SimWorld, ops
from zen_ext.core.registry import build_scheme
from zen_ext.reduction.scatter import reduce_scatter_flat
from zen_ext.reduction.synchronizer import Synchronizer

pytestmark = pytest.mark.skipif(not ops.has_lowbit_op(torch.zeros(1)), reason="needs the zen_ext C++ op")

REPLACED = ("aten.index_add_", "aten.where", "zen_ext.quantize_blocks")


class _Ops(TorchDispatchMode):
    """Every op dispatched, by name (a custom op is one, as one launch)."""

    def __init__(self):
        super().__init__()
        self.names: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names[str(func).rsplit(".", 1)[0]] += 1
        return func(*args, **(kwargs or {}))


def _second_step_ops(n: int, path: str) -> collections.Counter:
    from zen_ext.core.rs_base import even_ranges

    inputs = [bucket_inputs(n, seed=s) for s in range(2)]
    total = inputs[0][0].numel()

    def fn(comm):
        sync = Synchronizer(dp_comm=comm, scheme=build_scheme("zen"), param_kinds=KINDS,
                            dgc=dict(DGC, value_bits=4), natural={})
        got = collections.Counter()
        for step, x in enumerate(inputs):
            mode = _Ops() if step else None
            if mode is not None:
                mode.__enter__()
            if path == "all_reduce":
                sync.sync_flat(x[comm.rank], SLICES, "mean")
            else:
                reduce_scatter_flat(sync, x[comm.rank].clone(), SLICES, even_ranges(total, n), "mean")
            if mode is not None:
                mode.__exit__(None, None, None)
                got = mode.names
            sync.end_step()
        return got

    return SimWorld(n).run(fn)[0]


@pytest.mark.parametrize("path", ["all_reduce", "reduce_scatter"])
def test_one_fused_op_each_and_none_of_the_ops_they_replaced(path):
    per_n = {}
    for n in (3, 8):
        got = _second_step_ops(n, path)
        fused = {k: got[f"zen_ext.{k}"] for k in ops.FUSED_LOWBIT_OPS}
        assert fused == {k: 1 for k in ops.FUSED_LOWBIT_OPS}, (n, fused)  # one low-bit gradient: the DGC slices
        replaced = REPLACED + (("zen_ext.dequantize_blocks",) if path == "all_reduce" else ())
        assert not [k for k in got if k.startswith(replaced)], (n, got)
        per_n[n] = fused
    assert per_n[3] == per_n[8]
