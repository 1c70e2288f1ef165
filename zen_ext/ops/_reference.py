"""Pure-torch reference of the zen_ext hashing ops; the C++ and CUDA ops must match it exactly.

h0 is a keyed pseudo-random *permutation* ``P`` of ``[0, numel)``: a 4-round unbalanced Feistel network over the
smallest bit domain ``[0, 2**bits)`` that holds ``numel``, made exact on ``[0, numel)`` by cycle walking.
Its round function is MurmurHash3's ``fmix32`` finalizer. An index ``idx`` belongs to partition
``P(idx) % n`` at local position ``P(idx) // n``. Because ``P`` is a bijection, the ordered index set
of partition ``i`` is ``𝕀_i[p] = P⁻¹(i + p·n)``: the hash-bitmap decoder computes it on the fly and
never stores the ``numel``-sized table the paper precomputes (its memory would equal the gradient's).

Legend: ``_K`` non-zeros, ``_P`` partitions, ``_R`` Feistel rounds.
"""

from __future__ import annotations

import math

import torch

NUM_ROUNDS = 4
MAX_NUMEL = 2**62  # int64 arithmetic of the reference (and 31-bit Feistel halves) stop here
_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1


def derive_keys(seed: int) -> torch.Tensor:
    """Expand one shared seed into ``NUM_ROUNDS`` 32-bit round keys with splitmix64.

    Returns:
        int64 tensor ``keys_R`` (values in ``[0, 2**32)``), identical on every rank for one seed.
    """
    x = seed & _MASK64
    keys = []
    for _ in range(NUM_ROUNDS):
        x = (x + 0x9E3779B97F4A7C15) & _MASK64
        z = x
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        z ^= z >> 31
        keys.append(z & _MASK32)
    return torch.tensor(keys, dtype=torch.int64)


def domain_bits(numel: int) -> int:
    """Width in bits of the Feistel domain for ``numel`` elements: ``[0, 2**bits)`` holds them (at least 2)."""
    return max(2, int(numel - 1).bit_length())


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2**32 for x, c < 2**32 without int64 overflow: split x into 16-bit halves.
    lo = (x & 0xFFFF) * c
    hi = ((x >> 16) * c) & 0xFFFF
    return (lo + (hi << 16)) & _MASK32


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer on int64 tensors holding values in ``[0, 2**32)``."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _feistel(x: torch.Tensor, keys: list[int], bits: int, inverse: bool) -> torch.Tensor:
    # Unbalanced Feistel network on [0, 2**bits): the left part has ceil(bits/2) bits, the right
    # floor(bits/2); each round swaps the roles (and widths), and an even number of rounds restores
    # them. Over 2**bits < 2·numel values, cycle walking needs < 2 rounds on average (a balanced
    # network over 4**ceil(bits/2) values needed up to 4).
    wl, wr = bits - bits // 2, bits // 2
    left, right = x >> wr, x & ((1 << wr) - 1)
    if not inverse:
        for k in keys:
            left, right = right, left ^ (fmix32(right ^ k) & ((1 << wl) - 1))
            wl, wr = wr, wl
    else:
        for k in reversed(keys):
            left, right = right ^ (fmix32(left ^ k) & ((1 << wr) - 1)), left
            wl, wr = wr, wl
    return (left << wr) | right


def permute(idx_K: torch.Tensor, numel: int, keys_R: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """``P(idx)`` (or ``P⁻¹`` with ``inverse``), a bijection of ``[0, numel)``; int64 in, int64 out."""
    if idx_K.dtype != torch.int64:
        raise TypeError(f"idx must be int64, got {idx_K.dtype}")
    if numel > MAX_NUMEL:
        raise ValueError(f"permute numel ({numel}) must be <= 2**62")
    if idx_K.numel() == 0:
        return idx_K.clone()
    if int(idx_K.min()) < 0 or int(idx_K.max()) >= numel:
        # Cycle walking only returns into [0, numel) for inputs that start there.
        raise ValueError(f"permute indices must lie in [0, {numel}), got [{int(idx_K.min())}, {int(idx_K.max())}]")
    if numel <= 1:
        return idx_K.clone()
    keys = [int(k) for k in keys_R.tolist()]
    bits = domain_bits(numel)
    y = _feistel(idx_K, keys, bits, inverse)
    # Cycle walking: the Feistel network permutes [0, 2**bits); re-applying it until the value falls
    # back into [0, numel) gives a permutation of [0, numel) (expected < 2 rounds since 2**bits < 2*numel).
    out = y.clone()
    todo = (out >= numel).nonzero().flatten()
    while todo.numel():
        nxt = _feistel(out[todo], keys, bits, inverse)
        out[todo] = nxt
        todo = todo[nxt >= numel]
    return out


def hash_partition(
    idx_K: torch.Tensor, numel: int, num_parts: int, keys_R: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group non-zero indices by partition ``h0(idx) = P(idx) % num_parts``.

    Returns:
        ``counts_P`` (int64), ``order_K`` (int64 positions into ``idx_K``, grouped by partition and
        stable inside one), ``pos_K`` (int64 local position ``P(idx) // num_parts`` of each grouped
        entry), ``stats_3`` (int64 collisions, serial writes, overflows: always 0 on this path).
    """
    y = permute(idx_K, numel, keys_R)
    part = y % num_parts
    order = torch.sort(part, stable=True).indices
    counts = torch.bincount(part, minlength=num_parts)
    pos = (y // num_parts)[order]
    return counts, order, pos, torch.zeros(3, dtype=torch.int64)


# ---------------------------------------------------------------------------------------------------
# ZEN's server-side aggregation and pull (wire format: csrc/pull_format.h and zen_ext/core/zen_wire.py)
# ---------------------------------------------------------------------------------------------------

FMT_COO, FMT_BITMAP, FMT_DENSE = 0, 1, 2
HEADER_BYTES = 16
_BIT_WEIGHTS = [1 << b for b in range(8)]


def part_size(numel: int, part: int, num_parts: int) -> int:
    """``|𝕀_part|``: positions ``p`` with ``p·num_parts + part < numel``."""
    return max(0, (numel - part + num_parts - 1) // num_parts)


def num_words(num_bits: int) -> int:
    """64-bit words of a bitmap of ``num_bits`` bits."""
    return (num_bits + 63) // 64


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of the server: fp32 for half types, the dtype itself otherwise."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _bytes_as(buf_B: torch.Tensor, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    # ``count`` elements of ``dtype`` at byte ``offset`` (copied, so any alignment works).
    esize = torch.empty(0, dtype=dtype).element_size()
    return buf_B[offset : offset + count * esize].clone().view(dtype)


def mask_to_words(mask_M: torch.Tensor) -> torch.Tensor:
    """A bool mask as int64 words, bit ``p`` of the little-endian bitmap = ``mask[p]``."""
    m = mask_M.numel()
    padded = torch.zeros(num_words(m) * 64, dtype=torch.uint8, device=mask_M.device)
    padded[:m] = mask_M.to(torch.uint8)
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=mask_M.device)
    return (padded.view(-1, 8) * weights).sum(1, dtype=torch.uint8).view(torch.int64)


def words_to_mask(words_W: torch.Tensor, num_bits: int) -> torch.Tensor:
    """Inverse of ``mask_to_words`` for the first ``num_bits`` bits."""
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=words_W.device)
    return (words_W.contiguous().view(torch.uint8).unsqueeze(1) & weights).ne(0).view(-1)[:num_bits]


def aggregate_push(
    payloads: list[torch.Tensor], part_size_: int, width: int, dtype: torch.dtype, idx_bytes: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sum pushed payloads into the compact buffer, in payload order; see ``zen_ext::aggregate_push``.

    Returns:
        ``acc`` ``[part_size, width]`` (fp32 for half types), ``words`` (int64 touched bitmap),
        ``count`` (int64 ``[1]``: set bits).
    """
    m, idt = part_size_, (torch.int32 if idx_bytes == 4 else torch.int64)
    device = payloads[0].device if payloads else torch.device("cpu")
    acc = torch.zeros((m, width), dtype=acc_dtype(dtype), device=device)
    touched = torch.zeros(m, dtype=torch.bool, device=device)
    vsz = torch.empty(0, dtype=dtype).element_size() * width
    for buf in payloads:
        nbytes = buf.numel()
        if nbytes == 0:
            continue
        if m and nbytes == m * vsz:
            acc += _bytes_as(buf, 0, m * width, dtype).view(m, width).to(acc.dtype)
            touched.fill_(True)
            continue
        if nbytes % (idx_bytes + vsz):
            raise ValueError(f"aggregate_push: a payload of {nbytes} bytes is neither dense nor whole pairs")
        k = nbytes // (idx_bytes + vsz)
        pos = _bytes_as(buf, 0, k, idt).to(torch.int64)
        if k and (int(pos.min()) < 0 or int(pos.max()) >= m):
            raise ValueError(f"aggregate_push: position outside [0, {m})")
        vals = _bytes_as(buf, k * idx_bytes, k * width, dtype).view(k, width).to(acc.dtype)
        acc.index_add_(0, pos, vals)  # sequential on the CPU: payload order, like the C++ op
        touched[pos] = True
    return acc, mask_to_words(touched), touched.sum().reshape(1).to(torch.int64)


def encode_pull(
    acc: torch.Tensor, words: torch.Tensor, count: int, fmt: int, divisor: int, dtype: torch.dtype, idx_bytes: int
) -> torch.Tensor:
    """The pull message ``[fmt, count | body]``; see ``zen_ext::encode_pull``."""
    m, width = acc.shape
    touched = words_to_mask(words, m)
    pos = touched.nonzero().flatten()
    if pos.numel() != count:
        raise ValueError(f"encode_pull: count ({count}) but {pos.numel()} bits set")
    src = acc if fmt == FMT_DENSE else acc[pos]
    vals = (src / divisor if divisor != 1 else src).to(dtype)
    header = torch.tensor([fmt, count], dtype=torch.int64, device=acc.device)
    if fmt == FMT_DENSE:
        parts = [header, vals]
    elif fmt == FMT_BITMAP:
        parts = [header, words, vals]
    else:
        parts = [header, pos.to(torch.int32 if idx_bytes == 4 else torch.int64), vals]
    return torch.cat([p.contiguous().reshape(-1).view(torch.uint8) for p in parts])


def decode_pull_(
    out: torch.Tensor, msg: torch.Tensor, part: int, num_parts: int, keys_R: torch.Tensor, idx_bytes: int
) -> None:
    """Write server ``part``'s pull message into ``out`` at ``P⁻¹(p·num_parts + part)``."""
    if msg.numel() == 0:
        return
    numel = out.shape[0]
    width = out.shape[1] if out.dim() == 2 else 1
    m = part_size(numel, part, num_parts)
    fmt, count = _bytes_as(msg, 0, 2, torch.int64).tolist()
    if fmt == FMT_DENSE:
        pos, at = torch.arange(m, device=out.device), HEADER_BYTES
    elif fmt == FMT_BITMAP:
        nw = num_words(m)
        pos = words_to_mask(_bytes_as(msg, HEADER_BYTES, nw, torch.int64), m).nonzero().flatten()
        at = HEADER_BYTES + 8 * nw
    elif fmt == FMT_COO:
        pos = _bytes_as(msg, HEADER_BYTES, count, torch.int32 if idx_bytes == 4 else torch.int64).to(torch.int64)
        at = HEADER_BYTES + count * idx_bytes
    else:
        raise ValueError(f"decode_pull_: bad format {fmt}")
    rows = pos.numel()
    vals = _bytes_as(msg, at, rows * width, out.dtype).view((rows,) + tuple(out.shape[1:]))
    if rows:
        idx = permute(pos * num_parts + part, numel, keys_R, inverse=True)
        out[idx] = vals


def catch_up_adamw_(p, g, m, v, age, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                    step: int, catch_up: bool) -> None:
    """CatchUpAdamW's step of one parameter in torch ops (``zen_ext.optim.CatchUpAdamW.step``'s steps),
    the oracle of the fused op (csrc/catch_up_adamw.h)."""
    # Step 1: decoupled weight decay on every weight, as AdamW; every coordinate ages.
    if weight_decay:
        p.mul_(1 - lr * weight_decay)
    age.add_(1)
    # Step 2: k steps of mean G/k and mean square G²/k, folded into the moments in closed form. A group
    # with catch_up off (gradients no compressor delays: natural sparsity's rows were not held back)
    # takes every gradient, zero or not: AdamW.
    sent = g != 0 if catch_up else torch.ones_like(g, dtype=torch.bool)
    g_mean = g / age
    keep1 = torch.pow(beta1, age)
    keep2 = torch.pow(beta2, age)
    m.copy_(torch.where(sent, keep1 * m + (1 - keep1) * g_mean, m))
    v.copy_(torch.where(sent, keep2 * v + (1 - keep2) * g * g_mean, v))  # G²/k
    # Step 3: the k steps' movement at once, bias-corrected at the global step.
    denom = (v.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
    update = torch.where(sent, age * m / denom, torch.zeros_like(m))
    p.add_(update, alpha=-lr / (1 - beta1 ** step))
    age.masked_fill_(sent, 0)

