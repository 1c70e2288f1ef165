"""``zen``: Balanced Parallelism with hierarchical hashing and hash-bitmap pull (ZEN paper §3).

Every rank is a worker and a server. With ``n`` ranks and ``K`` local non-zeros, rank ``r`` sends
about ``K·(n−1)/n`` COO pairs in the push and its aggregated partition (about ``|∪I|/n`` values, plus
the cheapest index encoding) to each of the ``n−1`` others in the pull — the same on every rank, which
is the point: paper Eq. 1, ``T = (n−1)/n · (γ_n + 1) · 2·M·d / b``.

Wire formats (indices never travel as floats):

* push: per peer one message ``[pos (int32, or int64 if numel ≥ 2^31) | values (gradient dtype)]``,
  or the peer's whole partition as dense values when that is not larger (its size tells them apart);
* pull: per server one message ``[header int64×2 = (format, count) | body]`` where the body is the
  cheapest of COO (``pos | values``), hash bitmap (``⌈|𝕀_i|/64⌉`` little-endian 64-bit words, i.e.
  ``⌈|𝕀_i|/8⌉`` bytes padded to 8, ``| values``), or dense (``|𝕀_i|`` values), so every rank knows how
  to decode it (paper Fig. 17a crossover). Layout: ``csrc/pull_format.h``.

Steps 3–5 run in fused ops (``zen_ext.ops.aggregate_push`` / ``encode_pull`` / ``decode_pull_``: C++ on
the CPU, CUDA kernels on the GPU, ``ops/_reference.py`` otherwise): one pass each, the result written
into the caller's ``out``, and no host read of pulled headers (host reads per call: the push counts and
the aggregated count, whatever ``n``).

Legend: ``_K`` non-zeros, ``_P`` partitions, ``_M`` one partition's index-set size, ``_N`` dense length.
"""

from __future__ import annotations

import threading

import torch

from ..comm.base import Communicator
from .. import ops
from .bitmap import bitmap_bytes
from .hashing import HashConfig, HashPartitioner
from .scheme import SyncScheme, register_scheme
from .timing import PhaseTimer
from .types import SparseGrad, acc_dtype, as_sparse, index_dtype
from .wire import pack

PULL_FORMATS = ("auto", "coo", "bitmap", "dense")
_FMT_COO, _FMT_BITMAP, _FMT_DENSE = ops._reference.FMT_COO, ops._reference.FMT_BITMAP, ops._reference.FMT_DENSE
_FMT_NAMES = {_FMT_COO: "coo", _FMT_BITMAP: "bitmap", _FMT_DENSE: "dense"}
_HEADER_BYTES = 16


def _start_pull(comm: Communicator, msg: torch.Tensor):
    """Start the pull; returns an iterator of ``(server, message)`` as each message is complete.

    With a communicator that offers ``all_gather_v_start(t)`` (returning a handle whose
    ``as_completed()`` yields ``(rank, tensor)`` as each peer's message lands), the messages are on
    the wire when this returns, and the caller decodes a partition while the others still travel.
    The blocking ``all_gather_v`` fallback has them all on return; the own message (no wire) comes
    first either way.
    """
    start = getattr(comm, "all_gather_v_start", None)
    if start is not None:
        return start(msg).as_completed()
    pulled = comm.all_gather_v(msg)
    return iter([(comm.rank, pulled[comm.rank])] + [(i, b) for i, b in enumerate(pulled) if i != comm.rank])


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
        5. Decode: every rank maps positions back to indices with ``P⁻¹`` and writes the dense result
           into ``out`` (when given; else a new tensor), each server's message as soon as it is there.
        """
        sg = as_sparse(grad)
        n, rank, numel = comm.size, comm.rank, sg.numel
        dtype, device = sg.values.dtype, sg.values.device
        idt = index_dtype(numel)
        width = sg.row_width
        # vsz: bytes of one value entry (a whole row in row form).
        isz, vsz = torch.empty(0, dtype=idt).element_size(), sg.values.element_size() * width
        row_shape = tuple(sg.values.shape[1:])
        part = self.partitioner(numel, n)
        # CUDA events on a GPU (perf_counter would time only the launches of the asynchronous phases,
        # and auto's compute model learns from these times); perf_counter on the CPU.
        timer = PhaseTimer(device, enabled=timings is not None)

        # Step 1: partition.
        timer.start("hash_s")
        counts_P, order_K, pos_K, _ = part.partition(sg.indices)
        vals_K = sg.values[order_K]
        pos_K = pos_K.to(idt)

        # Step 2: push.
        timer.start("push_s")
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
                local = torch.zeros((m_j,) + row_shape, dtype=acc_dtype(dtype), device=device)
                local.index_add_(0, pos_K[s:e].to(torch.int64), vals_K[s:e].to(local.dtype))
                send.append(pack(local.to(dtype)))
            else:
                send.append(pack(pos_K[s:e], vals_K[s:e]))
        recv = comm.exchange_v(send)

        # Step 3: aggregate into the compact buffer of this server's index set, the touched bitmap
        # set in the same pass (zen_ext::aggregate_push). The count is the one host read of this step:
        # the pull message's size depends on it.
        timer.start("aggregate_s")
        m = part.part_size(rank)
        if ops.has_aggregate_into_op(sg.values):
            acc, words = self._workspace(m, width, dtype, device)
            count_1 = ops.aggregate_push_into(acc, words, recv, width, dtype, isz)
        else:
            acc, words, count_1 = ops.aggregate_push(recv, m, width, dtype, isz)
        count = ops.read_aggregate_count(count_1)

        # Step 4: pull, in the cheapest format for this partition's aggregated count; the message
        # ([format, count | body], csrc/pull_format.h) is written in one pass, mean's division included.
        timer.start("pull_s")
        fmt = self._choose_format(count, m, isz, vsz)
        msg = ops.encode_pull(acc, words, count, fmt, n if op == "mean" else 1, dtype, isz)
        del acc, words

        # Step 5: decode every server's partition straight into the result (the caller's buffer when
        # given): zero it while the pull is on the wire (the input was consumed in step 1, so the
        # caller's buffer may be the gradient itself), then each message's values land at
        # P⁻¹(p·n + i) (zen_ext::decode_pull_ reads the header itself: no host read). Partitions are
        # decoded in the order they arrive. Phases: pull_s = encoding plus waiting for messages,
        # decode_s = zeroing plus decoding.
        arrived = iter(_start_pull(comm, msg))
        timer.start("decode_s")
        res = out if out is not None else torch.empty(numel * width, dtype=dtype, device=device)
        ops.zero_(res)
        rows = res.view(numel, width) if width > 1 else res
        keys = part.keys_on(device)
        while True:
            timer.start("pull_s")
            item = next(arrived, None)
            if item is None:
                break
            timer.start("decode_s")
            ops.decode_pull_(rows, item[1], item[0], n, keys, isz)
        timer.write_into(timings)
        if timings is not None:
            timings["pull_format"] = _FMT_NAMES[fmt]
        return res

    def _workspace(self, m: int, width: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The server's compact buffer and bitmap words for a partition of ``m`` rows, as views of
        buffers kept between calls (CPU: a fresh one per call is a new mapping whose page faults cost
        more than the aggregation). Per thread: SimWorld ranks and communication workers may share
        one scheme object. Grows to the largest partition seen; holds about bucket/n elements."""
        tls = self.__dict__.get("_tls") or self.__dict__.setdefault("_tls", threading.local())
        ws = getattr(tls, "ws", None)
        if ws is None:
            ws = tls.ws = {}
        adt = acc_dtype(dtype)
        key = (device, adt)
        nw = (m + 63) // 64
        acc, words = ws.get(key, (None, None))
        if acc is None or acc.numel() < m * width or words.numel() < nw:
            acc = torch.empty(max(m * width, 1), dtype=adt, device=device)
            words = torch.empty(max(nw, 1), dtype=torch.int64, device=device)
            ws[key] = (acc, words)
        return acc[: m * width].view(m, width), words[:nw]

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_tls", None)  # the workspace stays with the process and thread that made it
        return state

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
