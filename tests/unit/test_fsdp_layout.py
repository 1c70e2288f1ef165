"""``zen_ext.fsdp.chunk_layout`` against FSDP2's own copy-in (``torch.ops.fsdp.chunk_cat``): every slice is
its parameter's rows in that chunk, padding lies in no slice, and ``start`` is the rows' offset inside the
parameter (DGC's memory key). Shapes not divisible by the world size, 1-D, one-row and empty chunks."""

from __future__ import annotations

import math

import pytest
import torch

from torch.distributed.fsdp._fully_shard._fsdp_collectives import foreach_reduce_scatter_copy_in
from torch.distributed.fsdp._fully_shard._fsdp_common import _get_dim0_padded_size

from zen_ext.fsdp import chunk_layout

SHAPES = [(11, 4), (5, 6), (5,), (1, 5), (1,), (3, 2, 2), (8, 3)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
def test_chunk_layout_matches_fsdp_copy_in(world):
    params = [(f"p{i}", s) for i, s in enumerate(SHAPES)]
    grads = [torch.arange(1, math.prod(s) + 1, dtype=torch.float32).view(s) + 1000 * i for i, s in enumerate(SHAPES)]
    numel = sum(_get_dim0_padded_size(g.size(), world).numel() for g in grads)
    flat = torch.full((numel,), float("nan"))
    foreach_reduce_scatter_copy_in(list(grads), flat, world)  # FSDP pads each dim 0 itself

    slices, got_numel = chunk_layout(params, world)
    assert got_numel == numel
    covered = torch.zeros(numel, dtype=torch.bool)
    for s in slices:
        g = grads[int(s.name[1:])].reshape(-1)
        assert torch.equal(flat[s.offset : s.offset + s.numel], g[s.start : s.start + s.numel]), s
        assert math.prod(s.shape) == s.numel and s.shape[1:] == SHAPES[int(s.name[1:])][1:]
        assert not covered[s.offset : s.offset + s.numel].any()
        covered[s.offset : s.offset + s.numel] = True
    # Every element of every parameter is in exactly one slice; the rest is padding (zeros).
    assert int(covered.sum()) == sum(g.numel() for g in grads)
    assert not flat[~covered].any()  # FSDP's padding is zeros
    # Each slice lies inside one rank's range.
    width = numel // world
    assert all(s.offset // width == (s.offset + s.numel - 1) // width for s in slices)


def test_the_hsdp_attachment_holds_the_step_keeping_and_has_no_reduce_scatter():
    """``ZenHSDP`` is no ``ZenFSDP``: it holds the shared step keeping (``FSDPSteps``) as ``ZenFSDP`` does and
    carries only its own collective (the all-reduce hook), not the 1-D path's reduce-scatter."""
    from zen_ext.engines.fsdp_steps import FSDPSteps
    from zen_ext.fsdp import ZenFSDP, ZenHSDP
    from zen_ext.reduction.attachment import ZenAttachment

    assert not issubclass(ZenHSDP, ZenFSDP) and issubclass(ZenHSDP, ZenAttachment)
    assert not hasattr(ZenHSDP, "reduce_scatter") and hasattr(ZenHSDP, "all_reduce")
    assert not hasattr(ZenFSDP, "all_reduce")
    assert all("steps" in cls.__slots__ for cls in (ZenFSDP, ZenHSDP))
    assert all(callable(getattr(FSDPSteps, m)) for m in ("start", "watch", "done", "end_step", "close"))
