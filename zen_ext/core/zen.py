"""``zen``: Balanced Parallelism with hierarchical hashing and hash-bitmap pull (ZEN paper §3).

Every rank is a worker and a server. With ``n`` ranks and ``K`` local non-zeros, rank ``r`` sends
about ``K·(n−1)/n`` COO pairs in the push and its aggregated partition (about ``|∪I|/n`` values, plus
the cheapest index encoding) to each of the ``n−1`` others in the pull — the same on every rank, which
is the point: paper Eq. 1, ``T = (n−1)/n · (γ_n + 1) · 2·M·d / b``.

Wire formats (indices never travel as floats):

* push: per peer one message ``[pos (int32, or int64 if numel ≥ 2^31) | values (gradient dtype)]``,
  or the peer's whole partition as dense values when that is not larger (its size tells them apart);
* pull: per server one message ``[header int64×2 = (format, count) | body]`` where the body is the
  cheapest of COO (``pos | values``), hash bitmap (``⌈|𝕀_i|/8⌉`` bytes padded to 8 ``| values``), or
  dense (``|𝕀_i|`` values), so every rank knows how to decode it (paper Fig. 17a crossover).

Legend: ``_K`` non-zeros, ``_P`` partitions, ``_M`` one partition's index-set size, ``_N`` dense length.
"""

from __future__ import annotations

import time

import torch

from ..comm.base import Communicator
from .bitmap import bitmap_bytes, decode_bitmap, encode_bitmap
from .hashing import HashConfig, HashPartitioner
from .scheme import SyncScheme, register_scheme
from .types import SparseGrad, as_sparse, index_dtype
from .wire import pack, view_as

PULL_FORMATS = ("auto", "coo", "bitmap", "dense")
_FMT_COO, _FMT_BITMAP, _FMT_DENSE = 0, 1, 2
_FMT_NAMES = {_FMT_COO: "coo", _FMT_BITMAP: "bitmap", _FMT_DENSE: "dense"}
_HEADER_BYTES = 16


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half-precision sums accumulate in fp32 on the server (more exact than a bf16 ring all-reduce);
    # values travel in the gradient's dtype on both phases.
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def pull_costs(count: int, part_size: int, idx_bytes: int, val_bytes: int) -> dict[int, int]:
    """Body bytes of each pull format for ``count`` non-zeros of a partition of ``part_size``."""
    bm = bitmap_bytes(part_size)
    return {
        _FMT_DENSE: part_size * val_bytes,
        _FMT_BITMAP: bm + (-bm % 8) + count * val_bytes,
        _FMT_COO: count * (idx_bytes + val_bytes),
    }


@register_scheme
class ZenScheme(SyncScheme):
    """Balanced Parallelism: hash-partition → push → aggregate → pull (hash bitmap) → dense result.

    Args:
        seed: shared hash seed; all ranks must use the same (checked by ``agree``).
        pull_format: ``"auto"`` picks the cheapest encoding per partition; ``"coo"``, ``"bitmap"``,
            ``"dense"`` force one (``"coo"`` is the paper's Fig. 17b ablation without hash bitmap).
        num_rehash, parallel_factor, serial_factor: Algorithm 1 parameters of the CUDA hashing op.
    """

    name = "zen"

    def __init__(
        self,
        seed: int = 0,
        pull_format: str = "auto",
        num_rehash: int = 3,
        parallel_factor: float = 2.0,
        serial_factor: float = 0.1,
    ) -> None:
        if pull_format not in PULL_FORMATS:
            raise ValueError(f"zen.pull_format ({pull_format!r}) must be one of {list(PULL_FORMATS)}")
        if not isinstance(num_rehash, int) or num_rehash < 0:
            raise ValueError(f"zen.num_rehash ({num_rehash!r}) must be an int >= 0")
        if not parallel_factor > 0:
            raise ValueError(f"zen.parallel_factor ({parallel_factor!r}) must be > 0")
        if not serial_factor > 0:
            raise ValueError(f"zen.serial_factor ({serial_factor!r}) must be > 0")
        self.seed = int(seed)
        self.pull_format = pull_format
        self.hash_config = HashConfig(num_rehash, float(parallel_factor), float(serial_factor))
        self._partitioners: dict[tuple[int, int], HashPartitioner] = {}

    def options(self) -> dict:
        c = self.hash_config
        return dict(seed=self.seed, pull_format=self.pull_format, num_rehash=c.num_rehash,
                    parallel_factor=c.parallel_factor, serial_factor=c.serial_factor)

    def partitioner(self, numel: int, n: int) -> HashPartitioner:
        key = (numel, n)
        p = self._partitioners.get(key)
        if p is None:  # a benign race under SimWorld threads: both build the same object
            p = self._partitioners[key] = HashPartitioner(numel, n, self.seed, self.hash_config)
        return p

    def _sync(
        self, comm: Communicator, grad: SparseGrad | torch.Tensor, op: str = "sum", timings: dict | None = None,
        key: str | None = None, out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Synchronize ``grad`` losslessly.

        1. Partition: h0 groups the local non-zeros by server (hashing, no sort of the data).
        2. Push: each server receives its partition's COO pairs from every rank.
        3. Aggregate: the server sums duplicates into its compact ``|𝕀_i|`` buffer (sum, never
           overwrite).
        4. Pull: the server sends its aggregate to every rank in the cheapest encoding.
        5. Decode: every rank maps positions back to indices with ``P⁻¹`` and writes the dense result.
        """
        t = {}
        sg = as_sparse(grad)
        n, rank, numel = comm.size, comm.rank, sg.numel
        dtype, device = sg.values.dtype, sg.values.device
        idt = index_dtype(numel)
        width = sg.row_width
        # vsz: bytes of one value entry (a whole row in row form).
        isz, vsz = torch.empty(0, dtype=idt).element_size(), sg.values.element_size() * width
        row_shape = tuple(sg.values.shape[1:])
        part = self.partitioner(numel, n)

        # Step 1: partition.
        t0 = time.perf_counter()
        counts_P, order_K, pos_K, _ = part.partition(sg.indices)
        vals_K = sg.values[order_K]
        pos_K = pos_K.to(idt)
        t["hash_s"] = time.perf_counter() - t0

        # Step 2: push.
        t0 = time.perf_counter()
        bounds = counts_P.cumsum(0).tolist()
        starts = [0] + bounds[:-1]
        send = []
        for j, (s, e) in enumerate(zip(starts, bounds)):
            m_j = part.part_size(j)
            if e == s:
                send.append(torch.empty(0, dtype=torch.uint8, device=device))
            elif (e - s) * (isz + vsz) >= m_j * vsz:
                # Denser than the partition itself: send it dense (pre-summed), exactly m_j·vsz bytes,
                # which a COO payload (strictly smaller by this rule) can never be.
                local = torch.zeros((m_j,) + row_shape, dtype=_acc_dtype(dtype), device=device)
                local.index_add_(0, pos_K[s:e].to(torch.int64), vals_K[s:e].to(local.dtype))
                send.append(pack(local.to(dtype)))
            else:
                send.append(pack(pos_K[s:e], vals_K[s:e]))
        recv = comm.exchange_v(send)
        t["push_s"] = time.perf_counter() - t0

        # Step 3: aggregate into the compact buffer of this server's index set.
        t0 = time.perf_counter()
        m = part.part_size(rank)
        acc = torch.zeros((m,) + row_shape, dtype=_acc_dtype(dtype), device=device)
        touched = torch.zeros(m, dtype=torch.bool, device=device)
        pos_in, val_in = [], []
        for buf in recv:
            if m and buf.numel() == m * vsz:  # dense push payload
                acc += view_as(buf, 0, m * width, dtype).view((m,) + row_shape).to(acc.dtype)
                touched.fill_(True)
                continue
            k = buf.numel() // (isz + vsz)
            if k:
                pos_in.append(view_as(buf, 0, k, idt))
                val_in.append(view_as(buf, k * isz, k * width, dtype).view((k,) + row_shape))
        if pos_in:
            p_all = torch.cat(pos_in).to(torch.int64)
            acc.index_add_(0, p_all, torch.cat(val_in).to(acc.dtype))
            touched[p_all] = True
        pos_out = touched.nonzero().flatten()
        val_out = acc[pos_out]
        if op == "mean":
            val_out = val_out / n
        val_out = val_out.to(dtype)
        t["aggregate_s"] = time.perf_counter() - t0

        # Step 4: pull, in the cheapest format for this partition's aggregated count.
        t0 = time.perf_counter()
        count = pos_out.numel()
        fmt = self._choose_format(count, m, isz, vsz)
        if fmt == _FMT_DENSE:
            body = [acc.div(n).to(dtype) if op == "mean" else acc.to(dtype)]
        elif fmt == _FMT_BITMAP:
            bm = encode_bitmap(touched)
            body = [bm, torch.zeros(-bm.numel() % 8, dtype=torch.uint8, device=device), val_out]
        else:
            body = [pos_out.to(idt), val_out]
        header = torch.tensor([fmt, count], dtype=torch.int64, device=device)
        pulled = comm.all_gather_v(pack(header, *body))
        t["pull_s"] = time.perf_counter() - t0

        # Step 5: decode every server's partition into the dense result.
        t0 = time.perf_counter()
        ys, vs = [], []
        for i, buf in enumerate(pulled):
            fmt_i, cnt = view_as(buf, 0, 2, torch.int64).tolist()
            m_i = part.part_size(i)
            if fmt_i == _FMT_DENSE:
                pos = torch.arange(m_i, device=device)
                vals = view_as(buf, _HEADER_BYTES, m_i * width, dtype).view((m_i,) + row_shape)
            elif fmt_i == _FMT_BITMAP:
                nb = bitmap_bytes(m_i)
                pos = decode_bitmap(buf[_HEADER_BYTES : _HEADER_BYTES + nb], m_i)
                vals = view_as(buf, _HEADER_BYTES + nb + (-nb % 8), cnt * width, dtype).view((cnt,) + row_shape)
            else:
                pos = view_as(buf, _HEADER_BYTES, cnt, idt).to(torch.int64)
                vals = view_as(buf, _HEADER_BYTES + cnt * isz, cnt * width, dtype).view((cnt,) + row_shape)
            if pos.numel():
                ys.append(pos * n + i)
                vs.append(vals)
        out = torch.zeros((numel,) + row_shape, dtype=dtype, device=device)
        if ys:
            idx = part.unpermute(torch.cat(ys))
            out[idx] = torch.cat(vs)
        out = out.reshape(-1)
        t["decode_s"] = time.perf_counter() - t0
        if timings is not None:
            timings.update(t)
            timings["pull_format"] = _FMT_NAMES[fmt]
        return out

    def _choose_format(self, count: int, part_size: int, isz: int, vsz: int) -> int:
        if self.pull_format != "auto":
            return {"coo": _FMT_COO, "bitmap": _FMT_BITMAP, "dense": _FMT_DENSE}[self.pull_format]
        costs = pull_costs(count, part_size, isz, vsz)
        return min(costs, key=lambda f: (costs[f], -f))  # ties go to the simpler decode (dense first)


@register_scheme
class ZenCooScheme(ZenScheme):
    """``zen`` without the hash bitmap: the pull always uses COO (paper Fig. 17b ablation)."""

    name = "zen_coo"

    def __init__(self, seed: int = 0, num_rehash: int = 3, parallel_factor: float = 2.0,
                 serial_factor: float = 0.1) -> None:
        super().__init__(seed, "coo", num_rehash, parallel_factor, serial_factor)
