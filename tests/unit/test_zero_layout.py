"""The rank-major layout of ZeRO's owner segments (engines/deepspeed_zero3.py ``_layout``): slices tile
the bucket, embedding pieces keep whole rows in row form, ranges are contiguous per owner (uneven,
empty for an owner without segments)."""

import math

import torch

from zen_ext.engines.deepspeed_zero3 import _layout


def _zero3_segments(shapes, n):
    """ZeRO-3's chunking: chunk r of each parameter (ceil(numel / n)), rank-major."""
    segs = []
    for r in range(n):
        for i, shape in enumerate(shapes):
            numel = math.prod(shape)
            c = math.ceil(numel / n)
            a, b = min(r * c, numel), min((r + 1) * c, numel)
            segs.append((r, torch.zeros(b - a), f"p{i}", a, shape))
    return segs


def test_slices_tile_the_bucket_and_keep_rows():
    shapes = [(37, 5), (7, 5), (7,)]
    for n in (1, 2, 3, 4, 16):
        segs = _zero3_segments(shapes, n)
        slices, ranges = _layout(segs, n)
        total = sum(math.prod(s) for s in shapes)
        # Ranges: contiguous, in rank order, tiling [0, total); a rank with nothing has an empty range.
        assert ranges[0][0] == 0 and ranges[-1][1] == total
        assert all(ranges[r][1] == ranges[r + 1][0] for r in range(n - 1))
        assert [e - s for s, e in ranges] == [sum(v.numel() for q, v, *_ in segs if q == r) for r in range(n)]
        # Slices tile the bucket in order, and each names the right place of its parameter.
        at = 0
        covered = {f"p{i}": [] for i in range(len(shapes))}
        for s in slices:
            assert s.offset == at and s.numel > 0
            at += s.numel
            covered[s.name].append((s.start, s.start + s.numel))
            width = math.prod(s.shape[1:]) if len(s.shape) >= 2 else 1
            if len(s.shape) >= 2:  # row form: whole rows, starting on a row
                assert s.start % width == 0 and s.numel % width == 0 and s.shape[0] * width == s.numel
        assert at == total
        for i, shape in enumerate(shapes):  # every element of every parameter exactly once
            parts = sorted(covered[f"p{i}"])
            assert parts[0][0] == 0 and parts[-1][1] == math.prod(shape)
            assert all(parts[k][1] == parts[k + 1][0] for k in range(len(parts) - 1))


def test_whole_parameter_keeps_its_shape():
    slices, ranges = _layout([(1, torch.zeros(12), "w", 0, (3, 4))], 3)
    assert ranges == [(0, 0), (0, 12), (12, 12)]
    assert [(s.name, s.offset, s.numel, s.shape, s.start) for s in slices] == [("w", 0, 12, (3, 4), 0)]


def test_cut_rows_become_1d_pieces():
    # Elements 2..13 of a (4, 5) parameter: a partial row (2..5), rows 1-1 (5..10), a partial row (10..13).
    slices, _ = _layout([(0, torch.zeros(11), "e", 2, (4, 5))], 1)
    assert [(s.offset, s.numel, s.shape, s.start) for s in slices] == [(0, 3, (3,), 2), (3, 5, (1, 5), 5),
                                                                        (8, 3, (3,), 10)]
