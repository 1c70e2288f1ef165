"""``reduction/slices.py`` ``piece_slices``: the one function that cuts a parameter's piece into GradSlices
(FSDP2's ``chunk_layout``, ZeRO's ``_layout`` and ``clip_slices`` all call it). Whole rows in row form,
partial rows at either end 1-D, ``start`` the offset inside the parameter; the edge cases each former
copy had: a piece starting or ending mid-row, inside one row, empty pieces, 1-D and 0-d parameters,
rows of one element, the last (short) row of a chunk layout, a slice of a slice (``base``)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from zen_ext.engines.deepspeed_zero3 import _layout
from zen_ext.fsdp import chunk_layout
from zen_ext.reduction import clip_slices, piece_slices
from zen_ext.reduction.plan import GradSlice


def _rows(slices):
    return [(s.offset, s.numel, s.shape, s.start) for s in slices]


@pytest.mark.parametrize("start, numel, want", [
    (0, 20, [(7, 20, (4, 5), 0)]),                                   # the whole parameter keeps its shape
    (5, 10, [(7, 10, (2, 5), 5)]),                                   # whole rows, row-aligned
    (2, 11, [(7, 3, (3,), 2), (10, 5, (1, 5), 5), (15, 3, (3,), 10)]),  # mid-row start and end
    (2, 8, [(7, 3, (3,), 2), (10, 5, (1, 5), 5)]),                   # mid-row start, row-aligned end
    (5, 7, [(7, 5, (1, 5), 5), (12, 2, (2,), 10)]),                  # row-aligned start, mid-row end
    (6, 3, [(7, 3, (3,), 6)]),                                       # inside one row
    (3, 2, [(7, 2, (2,), 3)]),                                       # the rest of one row
    (15, 5, [(7, 5, (1, 5), 15)]),                                   # the last row
    (17, 3, [(7, 3, (3,), 17)]),                                     # the last row's end
    (8, 0, []),                                                      # an empty piece
    (20, 0, []),                                                     # an empty piece at the end
])
def test_a_piece_of_a_matrix(start, numel, want):
    assert _rows(piece_slices("e", (4, 5), start, numel, offset=7)) == want
    assert all(s.name == "e" for s in piece_slices("e", (4, 5), start, numel, offset=7))


def test_vectors_rows_of_one_element_and_scalars():
    assert _rows(piece_slices("b", (9,), 2, 5, 0)) == [(0, 5, (5,), 2)]  # 1-D: one 1-D slice
    assert _rows(piece_slices("b", (9,), 0, 9, 0)) == [(0, 9, (9,), 0)]
    assert _rows(piece_slices("b", (9,), 9, 0, 0)) == []
    # Rows of one element are not worth a row form: a piece is 1-D (the whole tensor keeps its shape).
    assert _rows(piece_slices("v", (6, 1), 1, 3, 0)) == [(0, 3, (3,), 1)]
    assert _rows(piece_slices("v", (6, 1), 0, 6, 0)) == [(0, 6, (6, 1), 0)]
    assert _rows(piece_slices("s", (), 0, 1, 4)) == [(4, 1, (), 0)]  # a 0-d parameter is whole
    # A 3-D parameter's rows are its dim-0 slabs.
    assert _rows(piece_slices("t", (3, 2, 2), 2, 8, 0)) == [(0, 2, (2,), 2), (2, 4, (1, 2, 2), 4), (6, 2, (2,), 8)]


def test_base_keys_a_slice_of_a_slice_by_its_parameter_offset():
    # Rows 2-3 of a (4, 5) parameter (a row-form slice starting at element 10), cut at 3..9 of it.
    assert _rows(piece_slices("e", (2, 5), 3, 6, 0, base=10)) == [(0, 2, (2,), 13), (2, 4, (4,), 15)]
    assert _rows(piece_slices("e", (2, 5), 0, 10, 0, base=10)) == [(0, 10, (2, 5), 10)]


@pytest.mark.parametrize("seed", range(5))
def test_pieces_tile_and_name_the_right_elements(seed):
    """Random pieces of random shapes: the slices tile the piece in order, each holds its parameter's
    elements ``[start, start + numel)``, row-form slices are whole rows starting on a row."""
    rng = random.Random(seed)
    for _ in range(200):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 3)))
        param = torch.arange(math.prod(shape)).view(shape)
        total = param.numel()
        a = rng.randint(0, total)
        b = rng.randint(a, total)
        offset = rng.randint(0, 9)
        bucket = torch.full((offset + b - a,), -1)
        bucket[offset:] = param.reshape(-1)[a:b]
        at = offset
        for s in piece_slices("p", shape, a, b - a, offset):
            assert s.offset == at and s.numel > 0 and math.prod(s.shape) == s.numel
            assert torch.equal(bucket[s.offset : s.offset + s.numel], param.reshape(-1)[s.start : s.start + s.numel])
            if len(s.shape) >= 2 or s.shape == shape:
                width = math.prod(shape[1:])
                assert s.start % width == 0 and s.shape[1:] == shape[1:]
            at += s.numel
        assert at == offset + b - a


def test_every_engine_cuts_alike():
    """FSDP2's chunks (whole rows; the last chunk short or padding only), ZeRO's owner segments (any
    offsets) and clip_slices give the same slices for the same piece of a parameter."""
    shape = (7, 3)
    slices, numel = chunk_layout([("w", shape), ("b", (7,))], 3)  # rows per chunk 3: 3, 3, 1 real rows
    per_rank = numel // 3
    w = [s for s in slices if s.name == "w"]
    assert _rows(w) == [(0, 9, (3, 3), 0), (12, 9, (3, 3), 9), (24, 3, (1, 3), 18)]
    assert [s for s in slices if s.offset >= 2 * per_rank and s.name == "b"] == [GradSlice("b", 33, 1, (1,), start=6)]
    for s in w:
        assert _rows(piece_slices("w", shape, s.start, s.numel, s.offset)) == _rows([s])
    # ZeRO: 21 elements over 2 owners, ceil(21 / 2) = 11: rank 1's piece starts mid-row (element 11).
    segs = [(0, torch.zeros(11), "w", 0, shape), (1, torch.zeros(10), "w", 11, shape)]
    z, ranges = _layout(segs, 2)
    assert ranges == [(0, 11), (11, 21)]
    assert z == piece_slices("w", shape, 0, 11, 0) + piece_slices("w", shape, 11, 10, 11)
    assert _rows(z) == [(0, 9, (3, 3), 0), (9, 2, (2,), 9), (11, 1, (1,), 11), (12, 9, (3, 3), 12)]
    # clip_slices of the whole parameter at the same cut: the same pieces, rebased.
    whole = [GradSlice("w", 0, 21, shape)]
    assert clip_slices(whole, 0, 11) + [
        GradSlice(s.name, s.offset + 11, s.numel, s.shape, s.start) for s in clip_slices(whole, 11, 21)] == z


def test_clip_slices_keeps_rows_where_a_cut_falls_mid_row():
    sl = [GradSlice("e", 4, 20, (4, 5)), GradSlice("b", 24, 3, (3,))]
    assert clip_slices(sl, 0, 30) == [GradSlice("e", 4, 20, (4, 5)), GradSlice("b", 24, 3, (3,))]  # whole
    assert _rows(clip_slices(sl, 6, 26)) == [(0, 3, (3,), 2), (3, 15, (3, 5), 5), (18, 2, (2,), 0)]
    assert clip_slices(sl, 0, 4) == [] and clip_slices(sl, 27, 40) == []  # nothing inside
