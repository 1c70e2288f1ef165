"""Fake (meta) kernels of every zen_ext op: output shapes and dtypes only, so torch.compile and
FakeTensor tracing can see through the ops. Imported by ``zen_ext.ops`` once ``zen_ext._C`` has
registered the schemas (csrc/zen_ext.cpp); tests/ops/test_fake_kernels.py holds each to its CPU op.
"""

from __future__ import annotations

import torch

from . import _reference, _reference_lowbit

_register = torch.library.register_fake


@_register("zen_ext::permute")
def _permute(idx, numel, keys, inverse):
    return torch.empty_like(idx)


@_register("zen_ext::hash_partition")
def _hash_partition(idx, numel, num_parts, keys, num_rehash=3, parallel_factor=2.0, serial_factor=0.1):
    k = idx.shape[0]
    return idx.new_empty(num_parts), idx.new_empty(k), idx.new_empty(k), idx.new_empty(3)


@_register("zen_ext::aggregate_push")
def _aggregate_push(payloads, part_size, width, dtype, idx_bytes):
    device = payloads[0].device if payloads else torch.device("cpu")
    acc = torch.empty((part_size, width), dtype=_reference.acc_dtype(dtype), device=device)
    words = torch.empty(_reference.num_words(part_size), dtype=torch.int64, device=device)
    # CUDA: [count, positions outside the partition] (read_aggregate_count); CPU: [count].
    return acc, words, torch.empty(1 if device.type == "cpu" else 2, dtype=torch.int64, device=device)


@_register("zen_ext::aggregate_push_into")
def _aggregate_push_into(acc, words, payloads, width, dtype, idx_bytes):
    return torch.empty(1, dtype=torch.int64, device=acc.device)


@_register("zen_ext::encode_pull")
def _encode_pull(acc, words, count, fmt, divisor, dtype, idx_bytes):
    m, width = acc.shape
    vsz = torch.empty(0, dtype=dtype).element_size() * width
    idx_b = {0: count * idx_bytes, 1: 8 * _reference.num_words(m), 2: 0}[fmt]
    rows = m if fmt == 2 else count
    return acc.new_empty(_reference.HEADER_BYTES + idx_b + rows * vsz, dtype=torch.uint8)


@_register("zen_ext::decode_pull_")
def _decode_pull(out, msg, part, num_parts, keys, idx_bytes):
    return None


@_register("zen_ext::decode_pulls_lowbit_")
def _decode_pulls_lowbit(out, msgs, keys, idx_bytes, bits, block, divisor):
    return None


@_register("zen_ext::zero_")
def _zero(t):
    return None


@_register("zen_ext::dgc_accumulate_select_")
def _dgc_accumulate_select(R, U, g_T, momentum, thr_U, ends_U, ok=None, capacity=-1):
    # Without a capacity the candidates' number is data-dependent: an unbacked size.
    n = capacity if capacity >= 0 else torch.library.get_ctx().new_dynamic_size()
    long = dict(dtype=torch.int64, device=R.device)
    return torch.empty(n, **long), R.new_empty(n), torch.empty(n, **long), torch.empty(1, **long)


@_register("zen_ext::dgc_threshold_search")
def _dgc_threshold_search(sorted_S, start_U, ns_U, k_U, first_U, v_C, unit_C, t_low_U, passes):
    return v_C.new_empty(start_U.shape[0]), v_C.new_empty(v_C.shape[0], dtype=torch.bool)


@_register("zen_ext::dgc_gather_kept")
def _dgc_gather_kept(keep_C, pos_C, v_C, ok, count_C):
    return pos_C.new_empty(keep_C.shape[0]), v_C.new_empty(keep_C.shape[0]), pos_C.new_empty(3)


@_register("zen_ext::dgc_sample_keys")
def _dgc_sample_keys(R, U, g_T, momentum, grid_S, unit_S, hash_U, stride_U, shift):
    return R.new_empty(grid_S.shape[0], dtype=torch.int64)


@_register("zen_ext::dgc_sort_unkey")
def _dgc_sort_unkey(keys, low_U, tiny, key_bits):
    return keys.new_empty(keys.shape[0], dtype=torch.float32), keys.new_empty(low_U.shape[0], dtype=torch.float32)


@_register("zen_ext::dgc_all_finite")
def _dgc_all_finite(g_T):
    return g_T[0].new_empty((), dtype=torch.bool)


@_register("zen_ext::dgc_int4_select")
def _dgc_int4_select(codes, scales, U, g_T, momentum, update, ends_T, blocks_T, thr_U, ends_U, ok=None, capacity=-1):
    n = capacity if capacity >= 0 else torch.library.get_ctx().new_dynamic_size()
    long = dict(dtype=torch.int64, device=codes.device)
    return torch.empty(n, **long), scales.new_empty(n), torch.empty(n, **long), torch.empty(1, **long)


@_register("zen_ext::dgc_int4_requantize_")
def _dgc_int4_requantize(codes, scales, U, g_T, ends_T, blocks_T, thr_U, ends_U, flush_stride, flush_phase, seed=-1):
    return None


@_register("zen_ext::catch_up_adamw_")
def _catch_up_adamw(p_T, g_T, m_T, v_T, age_T, lr, beta1, beta2, eps, weight_decay, step, catch_up):
    return None


@_register("zen_ext::gather_list")
def _gather_list(g_T, pos):
    return g_T[0].new_empty(pos.shape[0])


@_register("zen_ext::quantize_blocks")
def _quantize_blocks(values, seg_ends, bits, block):
    _, code, blk = _reference_lowbit.layout(list(seg_ends), bits, block)
    return (values.new_empty(code[-1], dtype=torch.uint8), values.new_empty(blk[-1], dtype=torch.float32),
            values.new_empty(values.shape[0], dtype=torch.float32))


@_register("zen_ext::dequantize_blocks")
def _dequantize_blocks(codes, scales, seg_ends, bits, block):
    return scales.new_empty(seg_ends[-1] if len(seg_ends) else 0)


@_register("zen_ext::quantize_sent_")
def _quantize_sent(values, order, residual, res_pos, seg_ends, bits, block):
    _, code, blk = _reference_lowbit.layout(list(seg_ends), bits, block)
    return (values.new_empty(code[-1], dtype=torch.uint8), values.new_empty(blk[-1], dtype=torch.float32),
            values.new_empty(order.shape[0], dtype=torch.float32))


@_register("zen_ext::dequantize_add_blocks_")
def _dequantize_add_blocks(acc, touched, pos, codes, scales, seg_ends, bits, block):
    return None


@_register("zen_ext::quantize_owned_")
def _quantize_owned(acc, pos, residual, seg_ends, bits, block, applied_dtype, divisor):
    _, code, blk = _reference_lowbit.layout(list(seg_ends), bits, block)
    return acc.new_empty(code[-1], dtype=torch.uint8), acc.new_empty(blk[-1], dtype=torch.float32)
