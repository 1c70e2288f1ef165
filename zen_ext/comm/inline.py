"""Counts in the payload: the capacity rule and the segment layout that ``exchange_v`` and
``all_gather_v`` share inside a Communicator slot (``comm/base.py``, "Counts in the payload").

A receiver must post a receive of the exact size before a byte arrives (NCCL and gloo have no probe).
Inside a slot, a call's sizes come from the counts its last call carried, which both sides of every
message saw: each message reserves ``next_capacity(last count)`` elements behind a 16-byte head
``[count, call signature]``, and a payload that outgrew its capacity sends the rest in a second round.
"""

from __future__ import annotations

COUNT_BYTES = 8  # the int64 count per message and variable-size call (the signature word is a check)
HEAD_BYTES = 16  # the count and the signature word in front of a payload


def next_capacity(count):
    """Elements the next call of a slot's collective reserves for a message that carried ``count`` this
    time: 1/16 headroom (DGC's per-pair counts move by a few percent between steps) and a small floor; 0
    after an empty message (pairs that were empty, like SparCML's non-partners, stay header-only).
    ``count``: an int, or a tensor of counts (the planner's predicted byte matrices)."""
    return (count > 0) * (count + count // 16 + 8)


def inline_segment_bytes(cap: int, elem_bytes: int) -> int:
    """Bytes of one count-carrying message: the 16-byte head and ``cap`` elements, padded to 8 bytes so
    that the next segment's head is aligned."""
    return HEAD_BYTES + -(-cap * elem_bytes // 8) * 8


def counted_bytes(cap: int, elem_bytes: int) -> int:
    """What the accounting counts of a segment: all of it but the signature word (a check, not traffic,
    as everywhere in ``comm/base.py``)."""
    return inline_segment_bytes(cap, elem_bytes) - (HEAD_BYTES - COUNT_BYTES)
