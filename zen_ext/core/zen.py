"""``zen``: Balanced Parallelism with hierarchical hashing and hash-bitmap pull (ZEN paper §3).

Every rank is a worker and a server. With ``n`` ranks and ``K`` local non-zeros, rank ``r`` sends
about ``K·(n−1)/n`` COO pairs in the push and its aggregated partition (about ``|∪I|/n`` values, plus
the cheapest index encoding) to each of the ``n−1`` others in the pull — the same on every rank, which
is the point: paper Eq. 1, ``T = (n−1)/n · (γ_n + 1) · 2·M·d / b``.

Wire formats (indices never travel as floats):

* push: per peer one message ``[pos (int32, or int64 if numel ≥ 2^31) | values (gradient dtype)]``,
  or the peer's whole partition as dense values when that is not larger (its size tells them apart);
* pull: per server one message ``[header (format, count) | body]`` in the cheapest of COO, hash
  bitmap and dense: ``core/zen_wire.py`` (shared with the reduce-scatter, ``core/rs_zen.py``).

Steps 3–5 run in fused ops (``zen_ext.ops.aggregate_push`` / ``encode_pull`` / ``decode_pull_``: C++ on
the CPU, CUDA kernels on the GPU, ``ops/_reference.py`` otherwise): one pass each, the result written
into the caller's ``out``, and no host read of pulled headers (host reads per call: the push counts and
the aggregated count, whatever ``n``; ``sync_group`` reads them once for a whole group of gradients).

Legend: ``_K`` non-zeros, ``_P`` partitions, ``_M`` one partition's index-set size, ``_N`` dense length.
"""

from __future__ import annotations

import threading

import torch

from ..comm.base import Communicator
from .. import ops
from .cost import BLOCK_SIZE, Dims, ProfileView, Traffic, WorkCounts
from .hashing import HashConfig, HashPartitioner
from .scheme import PartitionFn, SyncScheme
from .types import SparseGrad, acc_dtype, as_sparse
from .wire import pack
from . import lowbit
from .zen_count import CONTRIBUTORS, aggregate_counted
from .zen_lowbit import sync_group_lowbit
from .zen_wire import FMT_BY_NAME, FMT_NAMES, HEADER_BYTES, PULL_FORMATS, ZenCall, cheapest_format, pull_costs


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


class ZenScheme(SyncScheme):
    """Balanced Parallelism: hash-partition → push → aggregate → pull (hash bitmap) → dense result.

    Args:
        seed: shared hash seed; all ranks must use the same (checked by ``agree``).
        pull_format: ``"auto"`` picks the cheapest encoding per partition; ``"coo"``, ``"bitmap"``,
            ``"dense"`` force one (``"coo"`` is the paper's Fig. 17b ablation without hash bitmap).
        num_rehash, parallel_factor, serial_factor: Algorithm 1 parameters of the CUDA hashing op.
    """

    name = "zen"
    reduce_scatter_form = "zen"
    carries_low_bits = True  # zen.dgc.value_bits: core/zen_lowbit.py
    counts_contributors = True  # op="contributors": the owners count the senders (core/zen_count.py)
    wire_phases = ("push_s", "pull_s")

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

    def push_aggregate(self, comm: Communicator, calls: list["ZenCall"], op: str, exchange=None) -> None:
        """Steps 1–3 of ``_sync_group`` for every call of a group (shared with ``rs_zen``'s reduce-scatter):
        partition by h0, push (one host read of the group's partition counts, one exchange per call,
        carrying the call's signature), aggregate into each call's compact buffer. Leaves ``c.part``,
        ``c.m``, ``c.acc [m, width]``, ``c.words`` (touched bitmap) and ``c.count_1`` on each call.
        ``exchange``: None pushes each call in its own exchange under its ``sync`` signature; else a
        callable taking every call's per-peer payloads and returning every call's received ones (the
        reduce-scatter packs the group into one exchange under the signature it declared).
        """
        n, rank = comm.size, comm.rank

        # Step 1: partition.
        for c in calls:
            c.timer.start("hash_s")
            c.part = self.partitioner(c.sg.numel, n)
            counts_P, order_K, pos_K, _ = c.part.partition(c.sg.indices)
            c.counts_P = counts_P.to(torch.int64)
            c.vals_K = c.sg.values[order_K]
            c.pos_K = pos_K.to(c.idt)
            c.timer.stop()

        # Step 2: push. The partition counts of the whole group in one host read (they cut the payloads).
        bounds_G = torch.stack([c.counts_P for c in calls]).cumsum(1).tolist()
        sends = []
        for c, bounds in zip(calls, bounds_G):
            c.timer.start("push_s")
            starts = [0] + bounds[:-1]
            send = []
            for j, (s, e) in enumerate(zip(starts, bounds)):
                m_j = c.part.part_size(j)
                if e == s:
                    send.append(torch.empty(0, dtype=torch.uint8, device=c.device))
                elif op != CONTRIBUTORS and (e - s) * (c.isz + c.vsz) >= m_j * c.vsz:
                    # Denser than the partition itself: send it dense (pre-summed), exactly m_j·vsz bytes,
                    # which a COO payload (strictly smaller by this rule) can never be. Not when the owner
                    # counts senders (core/zen_count.py): a dense payload hides which positions were sent.
                    local = torch.zeros((m_j,) + c.row_shape, dtype=acc_dtype(c.dtype), device=c.device)
                    local.index_add_(0, c.pos_K[s:e].to(torch.int64), c.vals_K[s:e].to(local.dtype))
                    send.append(pack(local.to(c.dtype)))
                else:
                    send.append(pack(c.pos_K[s:e], c.vals_K[s:e]))
            del c.pos_K, c.vals_K
            if exchange is None:
                # The push is this gradient's first collective: its header carries the gradient's signature.
                with comm.signed(c.sg.dense_numel, c.dtype, op, where=f"scheme {self.name!r}.sync"):
                    c.recv = comm.exchange_v(send)
            else:
                sends.append(send)
            c.timer.stop()
        if exchange is not None:  # the caller's one exchange for the whole group (under its signature)
            calls[0].timer.start("push_s")
            for c, recv in zip(calls, exchange(sends)):
                c.recv = recv
            calls[0].timer.stop()

        # Step 3: aggregate into the compact buffer of this server's index set, the touched bitmap set
        # in the same pass (zen_ext::aggregate_push); the group's counts in one host read (the pull
        # messages' sizes depend on them).
        for i, c in enumerate(calls):
            c.timer.start("aggregate_s")
            c.m = c.part.part_size(rank)
            if op == CONTRIBUTORS:  # the sum divided per position by its senders (core/zen_count.py)
                c.acc, c.words, c.count_1 = aggregate_counted(c, c.recv)
            else:
                c.acc, c.words, c.count_1 = ops.aggregate_push(
                    c.recv, c.m, c.width, c.dtype, c.isz, workspace=lambda c=c, i=i: self._workspace(
                        c.m, c.width, c.dtype, c.device, slot=i))
            del c.recv
            c.timer.stop()

    def _sync(
        self, comm: Communicator, grad: SparseGrad | torch.Tensor, op: str = "sum", timings: dict | None = None,
        key: str | None = None, out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Synchronize ``grad`` losslessly: ``_sync_group`` of one gradient."""
        return self._sync_group(comm, [as_sparse(grad)], op, [timings], [key], [out])[0]

    def _sync_group(
        self, comm: Communicator, grads: list[SparseGrad | torch.Tensor], op: str, timings: list[dict | None],
        keys: list[str | None], outs: list[torch.Tensor | None],
    ) -> list[torch.Tensor]:
        """Synchronize every gradient of ``grads`` losslessly, step by step for all of them, so the two
        host reads (partition counts, aggregated counts) happen once per group, not once per gradient.

        1. Partition: h0 groups each gradient's local non-zeros by server (hashing, no sort of the data).
        2. Push: one host read of every gradient's partition counts; each server receives its
           partition's COO pairs from every rank (one exchange per gradient).
        3. Aggregate: the server sums duplicates into its compact ``|𝕀_i|`` buffer (sum, never
           overwrite); one host read of every gradient's aggregated count.
        4. Pull: the server sends its aggregate to every rank in the cheapest encoding.
        5. Decode: every rank maps positions back to indices with ``P⁻¹`` and writes the dense result
           into ``out`` (when given; else a new tensor), each server's message as soon as it is there.
        Steps 4 and 5 run for one gradient after the other.
        """
        n = comm.size
        grads = [as_sparse(g) for g in grads]
        low = [i for i, g in enumerate(grads) if g.lowbit is not None]
        if low:  # zen.dgc.value_bits: quantized push and pull, owner error feedback (core/zen_lowbit.py)
            got = sync_group_lowbit(self, comm, [ZenCall(grads[i], timings[i]) for i in low], op,
                                    [outs[i] for i in low], [timings[i] for i in low])
            rest = [i for i in range(len(grads)) if grads[i].lowbit is None]
            results: list = [None] * len(grads)
            for i, r in zip(low, got):
                results[i] = r
            if rest:
                for i, r in zip(rest, self._sync_group(comm, [grads[i] for i in rest], op, [timings[i] for i in rest],
                                                       [keys[i] for i in rest], [outs[i] for i in rest])):
                    results[i] = r
            return results
        calls = [ZenCall(g, t) for g, t in zip(grads, timings)]
        self.push_aggregate(comm, calls, op)
        counts = ops.read_aggregate_counts([c.count_1 for c in calls])

        results = []
        for c, count, timing, out in zip(calls, counts, timings, outs):
            # Step 4: pull, in the cheapest format for this partition's aggregated count; the message
            # ([format, count | body], csrc/pull_format.h) is written in one pass, mean's division
            # included.
            c.timer.start("pull_s")
            fmt = self._choose_format(count, c.m, c.isz, c.vsz)
            msg = ops.encode_pull(c.acc, c.words, count, fmt, n if op == "mean" else 1, c.dtype, c.isz)
            del c.acc, c.words

            # Step 5: decode every server's partition straight into the result (the caller's buffer
            # when given): zero it while the pull is on the wire (the input was consumed in step 1, so
            # the caller's buffer may be the gradient itself), then each message's values land at
            # P⁻¹(p·n + i) (zen_ext::decode_pull_ reads the header itself: no host read). Partitions
            # are decoded in the order they arrive. Phases: pull_s = encoding plus waiting for
            # messages, decode_s = zeroing plus decoding.
            arrived = iter(_start_pull(comm, msg))
            c.timer.start("decode_s")
            numel, width = c.sg.numel, c.width
            res = out if out is not None else torch.empty(numel * width, dtype=c.dtype, device=c.device)
            ops.zero_(res)
            rows = res.view(numel, width) if width > 1 else res
            keys_dev = c.part.keys_on(c.device)
            while True:
                c.timer.start("pull_s")
                item = next(arrived, None)
                if item is None:
                    break
                c.timer.start("decode_s")
                ops.decode_pull_(rows, item[1], item[0], n, keys_dev, c.isz)
            c.timer.write_into(timing)
            if timing is not None:
                timing["pull_format"] = FMT_NAMES[fmt]
            results.append(res)
        return results

    def _workspace(self, m: int, width: int, dtype: torch.dtype, device, slot: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The server's compact buffer and bitmap words for a partition of ``m`` rows, as views of
        buffers kept between calls (CPU: a fresh one per call is a new mapping whose page faults cost
        more than the aggregation). Per thread: SimWorld ranks and communication workers may share
        one scheme object. Grows to the largest partition seen; holds about bucket/n elements.
        ``slot``: a group holds several aggregates at once, one buffer per member (its position)."""
        tls = self.__dict__.get("_tls") or self.__dict__.setdefault("_tls", threading.local())
        ws = getattr(tls, "ws", None)
        if ws is None:
            ws = tls.ws = {}
        adt = acc_dtype(dtype)
        key = (device, adt, slot)
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
        return cheapest_format(count, part_size, isz, vsz, self.pull_format)


    # --- cost model --------------------------------------------------------------------------------
    @staticmethod
    def predict_traffic(p: ProfileView, opts: dict) -> Traffic:
        """Push: COO per server, or the server's whole partition dense once that is not larger; pull:
        each server's aggregate in the format ``_choose_format`` picks (or ``pull_format``). With
        ``opts["value_bits"]`` (``zen.dgc.value_bits``, ``core/lowbit.py``): every push COO with its values'
        codes and scales, the pull's values the same (``lowbit.pull_costs``)."""
        bits = opts.get("value_bits")
        if bits:
            return ZenScheme._predict_traffic_lowbit(p, opts, int(bits))
        n, tr = p.n, Traffic(p.n)
        vsz = p.row_width * p.value_bytes
        part_P = torch.tensor([max(0, (p.numel - j + n - 1) // n) for j in range(n)], dtype=torch.float64)
        coo_PP = p.counts_PP("hash_counts") * p.entry_bytes
        dense_PP = (part_P * vsz).expand(n, n)
        tr.exchange_v(torch.where((coo_PP > 0) & (coo_PP >= dense_PP), dense_PP, coo_PP))
        # Pull: h0 balances the union, so each server holds ~|U|/n (exact per server when unsampled).
        if p.sample_parts == 1:
            union = p.union_set(tuple(range(n)), False)
            per_server = torch.bincount(HashPartitioner(p.numel, n, p.seed).partition_of(union),
                                        minlength=n).tolist()
        else:
            per_server = [p.union(range(n)) / n] * n
        fmt = opts.get("pull_format", "auto")

        def body(i: int) -> float:
            part = max(0, (p.numel - i + n - 1) // n)
            costs = pull_costs(int(round(per_server[i])), part, p.index_bytes, vsz)
            if fmt == "auto":
                return min(costs.values())
            return costs[FMT_BY_NAME[fmt]]

        tr.all_gather_v([HEADER_BYTES + body(i) for i in range(n)])
        return tr

    @staticmethod
    def _predict_traffic_lowbit(p: ProfileView, opts: dict, bits: int) -> Traffic:
        """``predict_traffic`` for element-form gradients whose values travel in ``bits``."""
        n, tr = p.n, Traffic(p.n)
        c_PP = p.counts_PP("hash_counts")
        tr.exchange_v(c_PP * p.index_bytes + lowbit.SCALE_BYTES[bits] * torch.ceil(c_PP / lowbit.VALUE_BLOCK[bits])
                      + torch.ceil(c_PP * bits / 8))
        per_server = ZenScheme._union_per_server(p)
        fmt = opts.get("pull_format", "auto")

        def body(i: int) -> float:
            part = max(0, (p.numel - i + n - 1) // n)
            costs = lowbit.pull_costs(int(round(per_server[i])), part, p.index_bytes, bits)
            return min(costs.values()) if fmt == "auto" else costs[FMT_BY_NAME[fmt]]

        tr.all_gather_v([HEADER_BYTES + body(i) for i in range(n)])
        return tr

    @staticmethod
    def _union_per_server(p: ProfileView) -> list[float]:
        """Each server's share of the union (h0 balances it; exact per server when unsampled)."""
        n = p.n
        if p.sample_parts == 1:
            union = p.union_set(tuple(range(n)), False)
            return torch.bincount(HashPartitioner(p.numel, n, p.seed).partition_of(union), minlength=n).tolist()
        return [p.union(range(n)) / n] * n

    @staticmethod
    def predict_work(w: WorkCounts, opts: dict) -> dict:
        d = Dims.of(w)
        per_server = d.S / d.n
        bitmap = opts.get("pull_format", "auto") != "coo" and d.U / d.n * d.ib > d.N / d.n / 8
        decode = {"fill_s_per_byte": d.dense_out, "hash_s_per_entry": d.U, "scatter_s_per_elem": d.U * d.W}
        if bitmap:
            decode["bitmap_s_per_bit"] = d.N
        return {"hash_s": {"hash_s_per_entry": d.K, "fill_s_per_byte": d.K * (d.W * d.vb + d.ib)},
                "aggregate_s": {"fill_s_per_byte": d.N / d.n * (d.W * d.ab + 1) + per_server * 8,
                                "scatter_s_per_elem": per_server * d.W * 2, "bitmap_s_per_bit": d.N / d.n},
                "decode_s": decode}

    @classmethod
    def partition_fn(cls, numel: int, n: int, *, seed: int = 0, row_width: int = 1,
                     block_size: int = BLOCK_SIZE) -> PartitionFn | None:
        """h0, the hash partition of indices (rows)."""
        return HashPartitioner(numel, n, seed).partition_of


class ZenCooScheme(ZenScheme):
    """``zen`` without the hash bitmap: the pull always uses COO (paper Fig. 17b ablation)."""

    name = "zen_coo"

    def __init__(self, seed: int = 0, num_rehash: int = 3, parallel_factor: float = 2.0,
                 serial_factor: float = 0.1) -> None:
        super().__init__(seed, "coo", num_rehash, parallel_factor, serial_factor)

    @staticmethod
    def predict_traffic(p: ProfileView, opts: dict) -> Traffic:
        return ZenScheme.predict_traffic(p, {**opts, "pull_format": "coo"})

    @staticmethod
    def predict_work(w: WorkCounts, opts: dict) -> dict:
        return ZenScheme.predict_work(w, {**opts, "pull_format": "coo"})
