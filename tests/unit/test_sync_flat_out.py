"""``Synchronizer.sync_flat(..., out=)``: the reduced bucket goes into the caller's buffer.

The result with ``out`` (a separate buffer, or the bucket itself) equals the result without it, for a
layout whose DGC slices tile one range (the scheme then writes into ``out``'s view, checked with a
spy) and for one with a gap between them (DGC-sized result copied per slice).
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_synchronizer import DGC, KINDS, NUMEL, SLICES, bucket_inputs
from zen_ext import SimWorld, build_scheme
from zen_ext.reduction.synchronizer import GradSlice, Synchronizer

# Same bucket with w2 moved right behind w1: the DGC slices tile [260, 2459).
TILED = [SLICES[0], SLICES[1], SLICES[2], GradSlice("w2", 1460, 999, (999,)), GradSlice("norm", 2464, 8, (8,))]


class SpyScheme:
    """Wraps a scheme; records the ``out`` tensors its ``sync`` receives."""

    def __init__(self, inner):
        self.inner, self.outs = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __repr__(self):  # ranks agree on the scheme by its repr
        return repr(self.inner)

    def sync(self, comm, grad, op="sum", timings=None, key=None, out=None):
        self.outs.append(out)
        return self.inner.sync(comm, grad, op, timings=timings, key=key, out=out)

    def sync_group(self, comm, grads, op="sum", timings=None, keys=None, outs=None):
        # The Synchronizer hands a bucket's natural rows and DGC slices over in one call.
        self.outs.extend(outs or [None] * len(grads))
        return self.inner.sync_group(comm, grads, op, timings=timings, keys=keys, outs=outs)


def _run(n, slices, mode, scheme="zen"):
    steps = [bucket_inputs(n, seed=5 * n + s) for s in range(2)]

    def fn(comm):
        spy = SpyScheme(build_scheme(scheme))
        sync = Synchronizer(dp_comm=comm, scheme=spy, param_kinds=KINDS, dgc=DGC, natural={})
        outs = []
        for inputs in steps:
            flat = inputs[comm.rank].clone()
            if mode == "none":
                res = sync.sync_flat(flat, slices, "mean")
            elif mode == "buffer":
                buf = torch.full_like(flat, float("nan"))
                res = sync.sync_flat(flat, slices, "mean", out=buf)
                assert res.data_ptr() == buf.data_ptr()
                assert torch.equal(flat, inputs[comm.rank]), "flat is not modified when out is another buffer"
            else:  # the bucket itself
                res = sync.sync_flat(flat, slices, "mean", out=flat)
                assert res.data_ptr() == flat.data_ptr()
            outs.append(res.clone())
            sync.end_step()
        return outs, spy.outs

    return SimWorld(n).run(fn)


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("layout", ["gap", "tiled"])
def test_out_equals_a_new_result(n, layout):
    slices = SLICES if layout == "gap" else TILED
    want = _run(n, slices, "none")
    for mode in ("buffer", "self"):
        got = _run(n, slices, mode)
        for r in range(n):
            for a, b in zip(got[r][0], want[r][0]):
                assert torch.equal(a, b), (mode, r)
            spy_outs = got[r][1]
            # Natural slices always receive their view of out; the DGC call does where the slices tile.
            assert spy_outs[0] is not None
            dgc_out = spy_outs[1]
            assert (dgc_out is not None) == (layout == "tiled")
            if layout == "tiled":
                assert dgc_out.numel() == 2459 - 260


def test_bad_out_is_rejected():
    def fn(comm):
        sync = Synchronizer(dp_comm=comm, scheme=build_scheme("zen"), param_kinds=KINDS, dgc=DGC, natural={})
        flat = torch.zeros(NUMEL)
        for bad in (torch.zeros(NUMEL - 1), torch.zeros(NUMEL, dtype=torch.float64), torch.zeros(2 * NUMEL)[::2]):
            with pytest.raises(ValueError, match="sync_flat: out"):
                sync.sync_flat(flat, SLICES, "sum", out=bad)
        return True

    assert SimWorld(1).run(fn) == [True]
