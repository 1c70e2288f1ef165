"""One check of zen_ext on a GPU machine (no internet needed): ``bash launch/gpu_check.sh``.

Single GPU (default) — each part is a row of the markdown report (``--out``, default
``benchmarks/gpu/results/gpu_check.md``):

0. ``ops``: every op with a CUDA kernel (``permute``, ``aggregate_push``, ``encode_pull`` in its three
   formats, ``decode_pull_``) against the C++ CPU op, byte for byte: fp32, bf16, fp16 and fp64, rows of
   width 1 and 4, int32 and int64 positions, sum and mean, sparse / empty / full / dense-payload
   partitions.
1. ``hash``: the CUDA hashing op against the C++ CPU op at the paper's scale (214 M elements, 5.2 %
   density by default): counts and each partition's entries and positions equal, ``P``/``P⁻¹`` round
   trip, index 0 and the last index, a forced overflow of the parallel memory (lossless and reported);
   the op's time from CUDA events (the paper: 6 ms on a V100).
2. ``schemes``: every registered scheme, ``auto`` included, in SimWorld on CUDA tensors (n = 8 and 16),
   fp32, bf16 and fp16, equal to the dense sum (integer-valued inputs: exact).
3. ``synchronizer``: the Synchronizer with DGC and natural rows on CUDA: natural rows equal the dense
   sum, every rank's result identical, equal to the same run on the CPU.
4. ``deepspeed``: the DeepSpeed engine on CUDA, world size 1 over NCCL: ZeRO 0, 1 and 2 with
   ``overlap_comm``, fp32, bf16 and fp16; dense DeepSpeed run twice (the floor: is it repeatable?),
   then ZEN with natural sparsity only, ``scheme`` ``zen`` and ``auto``: per-step losses (printed at
   full precision) bitwise equal to dense DeepSpeed's; at ZeRO 1/2 also with ``zen.async_sync``. With
   DGC (lossy by design) the lossless schemes must agree with each other: ``zen`` and ``auto`` equal
   to DGC with the ``dense`` scheme.
5. ``ddp``: torch DDP on CUDA, world size 1 over NCCL, with ZEN's comm hook (what ColossalAI's
   ``ZenTorchDDPPlugin`` registers), fp32/bf16/fp16 parameters, ``zen`` and ``auto``: losses equal to
   plain DDP's. Then ColossalAI's Booster with ``ZenTorchDDPPlugin`` when ColossalAI is installed.
6. ``gloo``: two processes sharing the GPU over gloo, CUDA gradients, under the NCCL guard; every
   scheme (``auto`` included) equal to ``all_reduce``; host synchronizations per synchronized bucket,
   with the Python line of each, and peak GPU memory per bucket.

``--multi`` (run under a launcher, one process per GPU: ``launch/gpu_check.sh --multi`` or
``deepspeed --num_gpus N benchmarks/gpu/gpu_check.py --multi``): every scheme over NCCL on CUDA tensors,
both exchange transports, against ``all_reduce``, plus the Synchronizer; host synchronizations and
peak memory per bucket; rank 0 writes ``benchmarks/gpu/results/gpu_check_multi.md``.

Without a GPU it exits with status 2 at once. ``--device cpu`` runs the CPU half of parts 2, 3 and 6
(and parts 0 and 1 as C++ op vs reference) at small sizes: that is what CI runs
(tests/unit/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

PARTS = ("ops", "hash", "schemes", "synchronizer", "deepspeed", "ddp", "gloo")
NO_GPU_MSG = ("gpu_check: no CUDA GPU is visible (torch.cuda.is_available() is False): this check needs one. "
              "It runs the CUDA kernel, CUDA tensors and NCCL; on a CPU-only machine the test suite covers the "
              "rest (see docs/gpu.md).")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="markdown report (default benchmarks/gpu/results/gpu_check[_multi].md)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--numel", type=int, default=214_000_000, help="hash check: dense length (paper: 214 M)")
    p.add_argument("--density", type=float, default=0.052, help="hash check: non-zero fraction (paper: 5.2 %%)")
    p.add_argument("--reps", type=int, default=20, help="hash check: timed repeats")
    p.add_argument("--sim-ranks", default="8,16", help="schemes check: SimWorld sizes")
    p.add_argument("--multi", action="store_true", help="multi-GPU NCCL check, under a launcher (one rank per GPU)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: the CPU half at small sizes (CI); cuda: the real check")
    a = p.parse_args(argv)
    a.parts = [x for x in a.parts.split(",") if x]
    bad = sorted(set(a.parts) - set(PARTS))
    if bad:
        p.error(f"--parts ({','.join(bad)}) must be a subset of {','.join(PARTS)}")
    if not 0 < a.density <= 1:
        p.error(f"--density ({a.density}) must be in (0, 1]")
    if a.numel < 2:
        p.error(f"--numel ({a.numel}) must be >= 2")
    a.sim_ranks = [int(x) for x in a.sim_ranks.split(",")]
    if a.out is None and a.device == "cpu":  # a CPU smoke run must not overwrite the GPU report
        a.out = os.path.join(ROOT, "runs", "gpu_check_cpu.md")
    elif a.out is None:
        a.out = os.path.join(ROOT, "benchmarks", "gpu", "results", "gpu_check_multi.md" if a.multi else "gpu_check.md")
    return a


class Report:
    """Rows of (part, check, ok, detail) and free-form notes, written as markdown."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, bool, str]] = []
        self.notes: list[str] = []

    def add(self, part: str, check: str, ok: bool, detail: str = "") -> None:
        self.rows.append((part, check, bool(ok), detail))
        print(f"[{'ok' if ok else 'FAIL'}] {part}: {check} {detail}", flush=True)

    @property
    def ok(self) -> bool:
        return bool(self.rows) and all(r[2] for r in self.rows)

    def markdown(self, title: str, env: str) -> str:
        lines = [f"# {title}", "", env, "", f"**{'PASS' if self.ok else 'FAIL'}**: "
                 f"{sum(r[2] for r in self.rows)}/{len(self.rows)} checks passed.", "",
                 "| part | check | result | detail |", "|---|---|---|---|"]
        lines += [f"| {p} | {c} | {'ok' if ok else '**FAIL**'} | {d} |" for p, c, ok, d in self.rows]
        failed = sorted({p for p, _, ok, _ in self.rows if not ok})
        if failed:
            lines += ["", "## What the failures mean for a user", ""]
            lines += [f"- **{p}**: {FAILURE_MEANS.get(p, 'see the rows above')}" for p in failed]
        if self.notes:
            lines += ["", "## Notes", ""] + [f"- {n}" for n in self.notes]
        return "\n".join(lines) + "\n"


FAILURE_MEANS = {
    "ops": "a CUDA kernel writes different bytes than the CPU op: ZEN on GPU gradients of that dtype/shape is "
           "not lossless (the values that arrive differ from a dense all-reduce). Use scheme \"agsparse\" or "
           "\"dense\" for those gradients until it is fixed.",
    "hash": "the CUDA hashing kernel disagrees with the CPU op: ZEN on GPU gradients may lose or misplace entries.",
    "schemes": "that scheme on CUDA tensors does not equal a dense all-reduce (or fails): training with it on GPUs "
               "is lossy or crashes; \"auto\" failing means the README's default config fails on GPUs.",
    "synchronizer": "an engine bucket (DGC + natural rows) on CUDA differs between ranks or from the CPU run.",
    "deepspeed": "DeepSpeed training with ZEN on a GPU diverges from dense DeepSpeed (natural sparsity is "
                 "lossless by contract) or from the dense scheme with the same DGC input, or fails to run.",
    "ddp": "torch DDP / ColossalAI training with ZEN's comm hook on a GPU diverges from plain DDP or fails.",
    "gloo": "multi-process ZEN with CUDA gradients over gloo differs from all_reduce or fails.",
}


def environment(device: str) -> str:
    import torch

    from zen_ext import ops

    gpu = torch.cuda.get_device_name() if device == "cuda" and torch.cuda.is_available() else "none"
    cuda_kernel = torch._C._dispatch_has_kernel_for_dispatch_key("zen_ext::hash_partition", "CUDA") \
        if ops.HAVE_CPP_OP else False
    return (f"GPU: {gpu}; torch {torch.__version__} (CUDA {torch.version.cuda}); C++ op: {ops.HAVE_CPP_OP}; "
            f"CUDA kernel: {cuda_kernel}; date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")


# --- host synchronizations and memory --------------------------------------------------------------------
def _where(filename: str) -> str:
    """A synchronizing line's file, relative to the repository, or from its package (no machine path)."""
    rel = os.path.relpath(filename, ROOT)
    return rel if not rel.startswith("..") else filename.rpartition("site-packages" + os.sep)[2]


class HostSyncCounter:
    """Count host synchronizations inside the block (CUDA: ``torch.cuda.set_sync_debug_mode("warn")``
    warns on every synchronizing call: ``.item()``, ``.tolist()``, ``nonzero``, D2H copies).

    Only the calling thread's warnings are recorded (``warnings.catch_warnings`` is process-wide), so
    use it around single-threaded code (one process per rank).
    """

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"
        self.count = 0
        self.lines: list[str] = []

    def __enter__(self):
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            self._cm = warnings.catch_warnings(record=True)
            self._got = self._cm.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        import torch

        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")
            hits = [w for w in self._got if "synchroniz" in str(w.message).lower()]
            self.count = len(hits)
            # The Python line that made each synchronizing call (the warning is attributed to it).
            self.lines = [f"{_where(w.filename)}:{w.lineno}" for w in hits]
            self._cm.__exit__(*exc)
        return False


# --- part 0: every op with a CUDA kernel against the C++ CPU op -------------------------------------------
def _pull_payloads(m: int, width: int, dtype, isz: int, case: str, seed: int):
    """Push payloads for one server of ``m`` positions (wire format: csrc/pull_format.h), as zen.py builds
    them: COO ``[positions | rows]`` (int32 or int64 positions, duplicates, index 0 and the last),
    a dense partition, or nothing."""
    import torch

    g = torch.Generator().manual_seed(seed)
    idt = torch.int32 if isz == 4 else torch.int64

    def coo(pos):
        shape = (pos.numel(),) if width == 1 else (pos.numel(), width)
        vals = torch.randint(-3, 4, shape, generator=g).to(dtype)
        return torch.cat([pos.to(idt).view(torch.uint8), vals.contiguous().view(torch.uint8).flatten()])

    if case == "empty":
        return [torch.empty(0, dtype=torch.uint8)] * 2
    if case == "full":  # every position, from two pushers, the second in reverse order
        return [coo(torch.arange(m)), coo(torch.arange(m).flip(0))]
    if case == "dense":  # a dense partition payload plus a COO one
        rows = torch.randint(-3, 4, (m, width), generator=g).to(dtype)
        return [rows.contiguous().view(torch.uint8).flatten(), coo(torch.tensor([0, m - 1, 5]))]
    pos = torch.randperm(m, generator=g)[: m * 3 // 10]
    pos[0], pos[1] = 0, m - 1
    dup = torch.cat([pos[:40], torch.tensor([0, 0, m - 1])])  # duplicates across and within pushers
    return [coo(pos), coo(dup), torch.empty(0, dtype=torch.uint8)]


def check_ops(rep: Report, device: str) -> None:
    """``aggregate_push`` → ``encode_pull`` (3 formats, sum and mean) → ``decode_pull_`` and ``permute``,
    each on the device against the C++ CPU op, byte for byte. ``device="cpu"``: C++ op vs reference."""
    import torch

    from zen_ext import ops
    from zen_ext.ops import _reference

    if not ops.HAVE_CPP_OP:
        rep.add("ops", "C++ op built", False, "zen_ext._C did not import: run launch/setup.sh")
        return
    if device == "cuda" and not torch._C._dispatch_has_kernel_for_dispatch_key("zen_ext::encode_pull", "CUDA"):
        rep.add("ops", "CUDA kernels built", False, "zen_ext._C has no CUDA kernel (docs/gpu.md)")
        return
    C = torch.ops.zen_ext

    def under_test(name):
        return getattr(C, name) if device == "cuda" else getattr(_reference, name)

    def bits(t):
        t = t.detach().cpu().contiguous()
        return t.view(torch.uint8) if t.dtype != torch.uint8 else t

    # Step 1: permute, both directions, index 0 and the last, domains of 2, odd and 2^31 + 1 elements.
    bad = []
    for numel in (2, 1000, 123_457, 2**31 + 1):
        g = torch.Generator().manual_seed(numel % 1000)
        idx = torch.cat([torch.tensor([0, numel - 1]), torch.randint(0, numel, (5000,), generator=g)])
        keys = ops.derive_keys(numel % 97)
        for inv in (False, True):
            want = C.permute(idx, numel, keys, inv)
            got = C.permute(idx.to(device), numel, keys.to(device), inv) if device == "cuda" else \
                _reference.permute(idx, numel, keys, inv)
            if not torch.equal(got.cpu(), want):
                bad.append(f"numel {numel} inverse {inv}")
    rep.add("ops", "permute equal to the C++ CPU op (P and P⁻¹)", not bad, "; ".join(bad) or "4 domains, 5002 indices")

    # Step 2: the pull ops, per dtype and partition case; each row covers widths, index widths,
    # formats and sum/mean.
    n_parts, part = 5, 3
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for case in ("sparse", "empty", "full", "dense"):
            bad, checked = [], 0
            for width in (1, 4, 9, 64):  # 9 and 64: rows wider than 16 bytes (decode_rows_kernel)
                for isz in (4, 8):
                    m = 1000
                    numel = m * n_parts + part  # partition `part` of numel has exactly m positions
                    assert _reference.part_size(numel, part, n_parts) == m
                    payloads = _pull_payloads(m, width, dtype, isz, case, seed=width * 10 + isz)
                    tag = f"w{width} i{isz}"
                    try:
                        acc_c, words_c, cnt_c = C.aggregate_push(payloads, m, width, dtype, isz)
                        dev_payloads = [p.to(device) for p in payloads]
                        acc_d, words_d, cnt_d = under_test("aggregate_push")(dev_payloads, m, width, dtype, isz)
                        count_c, count_d = ops.read_aggregate_count(cnt_c), ops.read_aggregate_count(cnt_d)
                        if not (torch.equal(bits(acc_d), bits(acc_c)) and torch.equal(words_d.cpu(), words_c)
                                and count_c == count_d):
                            bad.append(f"{tag} aggregate_push (count {count_d} vs {count_c})")
                            continue
                        keys = ops.derive_keys(11)
                        for fmt in (0, 1, 2):
                            for divisor in (1, 3):
                                checked += 1
                                msg_c = C.encode_pull(acc_c, words_c, count_c, fmt, divisor, dtype, isz)
                                msg_d = under_test("encode_pull")(acc_d, words_d, count_d, fmt, divisor, dtype, isz)
                                if not torch.equal(msg_d.cpu(), msg_c):
                                    diff = (msg_d.cpu() != msg_c).nonzero().flatten() if msg_d.numel() == msg_c.numel() \
                                        else torch.tensor([-1])
                                    bad.append(f"{tag} encode fmt {fmt} /{divisor}: {diff.numel()} bytes differ "
                                               f"(first at {diff[:3].tolist()})")
                                    continue
                                shape = (numel,) if width == 1 else (numel, width)
                                out_c = torch.zeros(shape, dtype=dtype)
                                C.decode_pull_(out_c, msg_c, part, n_parts, keys, isz)
                                # Received messages sit at any byte offset of the receive buffer.
                                for off in (0, 2, 5):
                                    buf = torch.empty(msg_c.numel() + off, dtype=torch.uint8, device=device)
                                    buf[off:].copy_(msg_c)
                                    out_d = torch.zeros(shape, dtype=dtype, device=device)
                                    under_test("decode_pull_")(out_d, buf[off:], part, n_parts, keys.to(device), isz)
                                    if not torch.equal(bits(out_d), bits(out_c)):
                                        bad.append(f"{tag} decode fmt {fmt} /{divisor} at byte offset {off}")
                    except Exception as exc:  # noqa: BLE001 — a row of the report
                        bad.append(f"{tag}: {type(exc).__name__}: {str(exc)[:120]}")
            rep.add("ops", f"aggregate_push/encode_pull/decode_pull_ {str(dtype)[6:]} {case} partition", not bad,
                    "; ".join(bad[:4]) + (f" (+{len(bad) - 4} more)" if len(bad) > 4 else "") if bad else
                    f"{checked} messages byte-equal (widths 1/4/9/64, int32/int64 positions, COO/bitmap/dense, "
                    "sum/mean; decoded at byte offsets 0/2/5)")

    # Step 3: DGC's threshold search (one kernel per bucket) on the device against the C++ CPU op;
    # ``device="cpu"``: the CPU op against the torch loop, its oracle.
    check_dgc_search(rep, device)
    check_dgc_select(rep, device)
    check_dgc_kept(rep, device)
    check_catch_up_adamw(rep, device)
    check_dgc_sample(rep, device)


def check_dgc_search(rep: Report, device: str) -> None:
    """``dgc_threshold_search`` per memory dtype, on buckets of equal, tiny and many units: thresholds
    and keep masks equal, bit for bit."""
    import math

    import torch

    import zen_ext.compress.dgc.thresholds as dgc
    import zen_ext.compress.dgc.units as units
    from zen_ext import ops

    if not ops.has_dgc_search_op(torch.zeros(1)) or (device == "cuda" and not torch._C._dispatch_has_kernel_for_dispatch_key(
            "zen_ext::dgc_threshold_search", "CUDA")):
        rep.add("ops", "dgc_threshold_search built", False, "zen_ext._C lacks the op on this device: rebuild (launch/setup.sh)")
        return
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        bad, checked = [], 0
        for sizes, density in (([4096] * 7, 0.01), ([1, 64, 5000, 65536, 3, 20000], 0.05), ([8192, 24576, 1024] * 20, 0.02)):
            g = torch.Generator().manual_seed(len(sizes))
            lay = units.Layout(tuple(f"p{i}" for i in range(len(sizes))), tuple(sizes), True, "cpu")
            R = torch.cat([torch.randn(n, generator=g, dtype=torch.float64) ** 3 * 10.0 ** (i % 5 - 2)
                           for i, n in enumerate(sizes)]).to(dtype)
            pos_S, ns_U = lay.sample_positions(density, 0.01, 7, "cpu")
            consts = lay.search_constants(ns_U, [max(1, math.ceil(density * n)) for n in sizes], list(sizes), "cpu")
            sorted_S = units.sort_per_unit(R.index_select(0, pos_S).abs(), consts.unit_S)
            tiny = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
            t_low = sorted_S.index_select(0, consts.low_S).clamp(min=tiny)  # the sample at rank CANDIDATE_FACTOR·first
            pos_C = lay.select(R, t_low).view(-1).nonzero().flatten()
            v_C, unit_C = R.index_select(0, pos_C), torch.searchsorted(lay.unit_ends_N, pos_C, right=True)
            args = (sorted_S, consts.start_U, consts.ns_U, consts.k_U, consts.first_U, v_C, unit_C, t_low)
            try:
                if device == "cuda":
                    want = ops.dgc_threshold_search(*args, dgc.REFINE_PASSES)
                    got = ops.dgc_threshold_search(*(a.to(device) for a in args), dgc.REFINE_PASSES)
                else:
                    with ops.force_reference("dgc_threshold_search"):  # the torch loop
                        want = ops.dgc_threshold_search(*args, dgc.REFINE_PASSES)
                    got = ops.dgc_threshold_search(*args, dgc.REFINE_PASSES)
                if not (torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])):
                    bad.append(f"{len(sizes)} units: thresholds or keep mask differ")
                checked += 1
            except Exception as exc:  # noqa: BLE001 — a row of the report
                bad.append(f"{len(sizes)} units: {type(exc).__name__}: {str(exc)[:120]}")
        rep.add("ops", f"dgc_threshold_search {str(dtype)[6:]} equal to the "
                + ("C++ CPU op" if device == "cuda" else "torch loop"), not bad,
                "; ".join(bad) or f"{checked} buckets (7 equal, 6 mixed-size, 60 units): thresholds and masks equal")


def check_dgc_select(rep: Report, device: str) -> None:
    """``dgc_accumulate_select_`` per memory and gradient dtype (fp32, fp64, bf16/fp16 gradients into fp32
    memory), with and without momentum, gradients as one tensor
    and as views back to back and apart, capacities that pad and that cut, the flag false: R, U,
    positions, values, runs and the count equal to the C++ CPU op's, bit for bit."""
    import torch

    from zen_ext import ops

    if device != "cuda":
        return  # the CPU op is held to the torch path by tests/ops/test_dgc_ops.py
    if not torch._C._dispatch_has_kernel_for_dispatch_key("zen_ext::dgc_accumulate_select_", "CUDA"):
        rep.add("ops", "dgc_accumulate_select_ built for CUDA", False, "zen_ext._C lacks the kernel: rebuild")
        return
    for dtype, gdt in ((torch.float32, torch.float32), (torch.float64, torch.float64), (torch.float32, torch.bfloat16),
                       (torch.float32, torch.float16)):
        bad, checked = [], 0
        for momentum in (None, 0.9):
            for layout in ("one", "adjacent", "apart"):
                for capacity, ok in ((200_000, True), (1000, True), (0, True), (200_000, False)):
                    g = torch.Generator().manual_seed(checked)
                    sizes = [1, 4095, 70_001, 3, 33_000]
                    N = sum(sizes)
                    bucket = torch.randn(N + 64, generator=g, dtype=torch.float64).to(gdt)
                    bucket[100] = float("nan")
                    if layout == "one":
                        g_T = [bucket[:N]]
                    elif layout == "adjacent":
                        g_T = list(bucket[:N].split(sizes))
                    else:  # copies: apart in memory
                        g_T = [t.clone() for t in bucket[:N].split(sizes)]
                    R = torch.randn(N, generator=g, dtype=torch.float64).to(dtype)
                    U = torch.randn(N, generator=g, dtype=torch.float64).to(dtype) if momentum else None
                    ends = torch.tensor([1, 4096, 74_097, N])
                    thr = torch.tensor([0.5, 2.0, 1.0, 3.0], dtype=dtype)
                    flag = torch.tensor(ok)
                    try:
                        want_R, want_U = R.clone(), None if U is None else U.clone()
                        want = ops.dgc_accumulate_select_(want_R, want_U, g_T, momentum or 0.0, thr, ends, flag, capacity)
                        got_R, got_U = R.to(device), None if U is None else U.to(device)
                        got = ops.dgc_accumulate_select_(got_R, got_U, [t.to(device) for t in g_T] if layout != "adjacent"
                                                         else list(bucket[:N].to(device).split(sizes)),
                                                         momentum or 0.0, thr.to(device), ends.to(device),
                                                         flag.to(device), capacity)
                        same = all(torch.equal(a.cpu(), b) for a, b in zip(got, want))
                        same &= torch.equal(got_R.cpu().nan_to_num(), want_R.nan_to_num())
                        same &= want_U is None or torch.equal(got_U.cpu().nan_to_num(), want_U.nan_to_num())
                        if not same:
                            bad.append(f"momentum {momentum}, {layout}, capacity {capacity}, ok {ok}: differ "
                                       f"(count {got[3].tolist()} vs {want[3].tolist()})")
                        checked += 1
                    except Exception as exc:  # noqa: BLE001 — a row of the report
                        bad.append(f"{layout}, capacity {capacity}: {type(exc).__name__}: {str(exc)[:120]}")
        rep.add("ops", f"dgc_accumulate_select_ {str(dtype)[6:]} memory, {str(gdt)[6:]} gradients: equal to the "
                "C++ CPU op", not bad,
                "; ".join(bad[:4]) or f"{checked} cases (momentum on/off, gradients one/back to back/apart, "
                "capacity padding/cutting/0, flag false): R, U, positions, values, runs, count equal")


def check_dgc_kept(rep: Report, device: str) -> None:
    """``dgc_gather_kept`` per value dtype, on candidate buffers of 0 to 3 M entries (more than the
    kernels' 1,024 tiles of 2,048), kept at random, all, none, or only the first and the last, the flag
    true/false/absent: kept positions and values, the zero padding and the three read-back values equal
    to the C++ CPU op's, bit for bit."""
    import torch

    from zen_ext import ops

    if device != "cuda":
        return  # the CPU op is held to nonzero + index_select by tests/ops/test_dgc_kept_op.py
    if not torch._C._dispatch_has_kernel_for_dispatch_key("zen_ext::dgc_gather_kept", "CUDA"):
        rep.add("ops", "dgc_gather_kept built for CUDA", False, "zen_ext._C lacks the kernel: rebuild")
        return
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        bad, checked = [], 0
        for C in (0, 1, 2047, 2049, 300_001, 3_000_017):
            for pattern, flag in (("random", True), ("all", None), ("none", False), ("ends", True)):
                g = torch.Generator().manual_seed(C + checked)
                keep = {"random": lambda: torch.rand(C, generator=g) < 0.4, "all": lambda: torch.ones(C, dtype=torch.bool),
                        "none": lambda: torch.zeros(C, dtype=torch.bool),
                        "ends": lambda: torch.arange(C).eq(0) | torch.arange(C).eq(C - 1)}[pattern]()
                pos = torch.randint(0, 1 << 40, (C,), generator=g)
                v = torch.randn(C, generator=g, dtype=torch.float64).to(dtype)
                ok = None if flag is None else torch.tensor([flag])
                count = torch.tensor([C + 3])
                try:
                    want = ops.dgc_gather_kept(keep, pos, v, ok, count)
                    got = ops.dgc_gather_kept(keep.to(device), pos.to(device), v.to(device),
                                              None if ok is None else ok.to(device), count.to(device))
                    if not all(torch.equal(a.cpu(), b) for a, b in zip(got, want)):
                        bad.append(f"{C} candidates, {pattern}: differ (stats {got[2].tolist()} vs {want[2].tolist()})")
                    checked += 1
                except Exception as exc:  # noqa: BLE001 — a row of the report
                    bad.append(f"{C} candidates, {pattern}: {type(exc).__name__}: {str(exc)[:120]}")
        rep.add("ops", f"dgc_gather_kept {str(dtype)[6:]}: equal to the C++ CPU op", not bad,
                "; ".join(bad[:4]) or f"{checked} cases (0 to 3 M candidates; kept at random/all/none/the ends; "
                "flag true/false/absent): positions, values, padding, stats equal")


def check_catch_up_adamw(rep: Report, device: str) -> None:
    """``catch_up_adamw_`` (CatchUpAdamW's fused step) per parameter dtype, tensors of 0 to 3 M elements,
    with and without catch-up, 6 steps of gradients that are mostly zero: weights and moments equal to the
    C++ CPU op's to an ulp or two (``powf`` may round differently on the device), ages exactly."""
    import torch

    from zen_ext import ops

    if device != "cuda":
        return  # the CPU op is held to the torch path by tests/unit/test_optim_catch_up.py
    if not torch._C._dispatch_has_kernel_for_dispatch_key("zen_ext::catch_up_adamw_", "CUDA"):
        rep.add("ops", "catch_up_adamw_ built for CUDA", False, "zen_ext._C lacks the kernel: rebuild")
        return
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)):
        bad = []
        for catch_up in (True, False):
            g = torch.Generator().manual_seed(7)
            sizes = [0, 1, 1000, 3_000_017]
            cpu = [[torch.randn(n, generator=g).to(dtype) for n in sizes] for _ in range(3)] + [
                [torch.zeros(n) for n in sizes]]
            dev = [[t.to(device) for t in ts] for ts in cpu]
            try:
                for step in range(1, 7):
                    grads = [(torch.randn(n, generator=g) * (torch.rand(n, generator=g) < 0.1)).to(dtype) for n in sizes]
                    kw = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-4, weight_decay=0.01, step=step, catch_up=catch_up)
                    ops.catch_up_adamw_(cpu[0], grads, cpu[1], cpu[2], cpu[3], **kw)
                    ops.catch_up_adamw_(dev[0], [x.to(device) for x in grads], dev[1], dev[2], dev[3], **kw)
                for name, a_T, b_T in zip(("weights", "m", "v", "ages"), cpu, dev):
                    for a, b in zip(a_T, b_T):
                        t = 0.0 if name == "ages" else tol
                        if not torch.allclose(a.float(), b.cpu().float(), rtol=t, atol=t):
                            bad.append(f"catch_up={catch_up}, {a.numel()} elements: {name} differ")
            except Exception as exc:  # noqa: BLE001 — a row of the report
                bad.append(f"catch_up={catch_up}: {type(exc).__name__}: {str(exc)[:120]}")
        rep.add("ops", f"catch_up_adamw_ {str(dtype)[6:]}: equal to the C++ CPU op", not bad,
                "; ".join(bad[:4]) or "0 to 3 M elements, with and without catch-up, 6 steps: weights and moments "
                f"within {tol:g}, ages equal")


def check_dgc_sample(rep: Report, device: str) -> None:
    """``dgc_sample_keys`` and ``dgc_sort_unkey`` per gradient dtype (fp32, bf16, fp16 into fp32 memory), with
    and without momentum, gradients back to back and apart, NaN/±inf/ties among the values, several
    steps: keys, sorted values and the candidates' thresholds equal to the C++ CPU op's, bit for bit."""
    import torch

    from zen_ext import ops
    from zen_ext.compress.dgc.units import Layout, sample_shift

    if device != "cuda":
        return  # the CPU ops are held to the torch path by tests/ops/test_dgc_ops.py
    if not torch._C._dispatch_has_kernel_for_dispatch_key("zen_ext::dgc_sample_keys", "CUDA"):
        rep.add("ops", "dgc_sample_keys built for CUDA", False, "zen_ext._C lacks the kernel: rebuild")
        return
    sizes = [1, 4095, 70_001, 3, 33_000, 1 << 20]
    N = sum(sizes)
    for gdt in (torch.float32, torch.bfloat16, torch.float16):
        bad, checked = [], 0
        for momentum in (None, 0.9):
            for layout in ("adjacent", "apart"):
                for step in (0, 7, 123_457):
                    g = torch.Generator().manual_seed(checked)
                    R = torch.randn(N, generator=g) * 2
                    R[[0, 5, 9, N - 1]] = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.0e38])
                    R[10:4000] = 1.5  # ties
                    U = torch.randn(N, generator=g) if momentum else None
                    bucket = torch.randn(N, generator=g).to(gdt)
                    g_T = list(bucket.split(sizes)) if layout == "adjacent" else [t.clone() for t in bucket.split(sizes)]
                    lay_c = Layout(tuple(f"t{i}" for i in range(len(sizes))), tuple(sizes), True, "cpu")
                    lay_d = Layout(lay_c.names, lay_c.numels, True, device)
                    try:
                        grid, ns_U, stride, unit, hsh = lay_c.sample_grid(0.01, 0.01, "cpu")
                        want = ops.dgc_sample_keys(R, U, g_T, momentum or 0.0, grid, unit, hsh, stride, sample_shift(step))
                        gd, _, sd, ud, hd = lay_d.sample_grid(0.01, 0.01, device)
                        g_dev = (list(bucket.to(device).split(sizes)) if layout == "adjacent"
                                 else [t.to(device) for t in g_T])
                        got = ops.dgc_sample_keys(R.to(device), None if U is None else U.to(device), g_dev,
                                                  momentum or 0.0, gd, ud, hd, sd, sample_shift(step))
                        k_U = [max(1, int(0.01 * n + 0.999)) for n in sizes]
                        cc = lay_c.search_constants(ns_U, k_U, sizes, "cpu")
                        cd = lay_d.search_constants(ns_U, k_U, sizes, device)
                        w_vals, w_low = ops.dgc_sort_unkey(want, cc.low_S, 1e-45, lay_c.key_bits)
                        g_vals, g_low = ops.dgc_sort_unkey(got, cd.low_S, 1e-45, lay_d.key_bits)
                        same = (torch.equal(got.cpu(), want) and torch.equal(g_vals.cpu().view(torch.int32),
                                                                             w_vals.view(torch.int32))
                                and torch.equal(g_low.cpu(), w_low))
                        if not same:
                            bad.append(f"momentum {momentum}, {layout}, step {step}: differ")
                        checked += 1
                    except Exception as exc:  # noqa: BLE001 — a row of the report
                        bad.append(f"{layout}, step {step}: {type(exc).__name__}: {str(exc)[:120]}")
        rep.add("ops", f"dgc_sample_keys + dgc_sort_unkey, {str(gdt)[6:]} gradients: equal to the C++ CPU op", not bad,
                "; ".join(bad[:4]) or f"{checked} cases (momentum on/off, gradients back to back/apart, 3 steps, "
                "NaN/inf/ties): keys, sorted values, thresholds equal")
    # dgc_all_finite: the flag of a list, NaN/±inf at a tensor's first or last element, or none.
    bad, checked = [], 0
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        for where in (None, (0, 0), (1, -1), (2, 0), (2, -1)):
            for value in (float("nan"), float("inf"), -float("inf")):
                g_T = [torch.randn(n, dtype=torch.float64).to(dtype) for n in (5000, 0, 1 << 20)]
                if where is not None and g_T[where[0]].numel():
                    g_T[where[0]][where[1]] = value
                want = ops.dgc_all_finite(g_T)
                got = ops.dgc_all_finite([t.to(device) for t in g_T])
                got_adj = ops.dgc_all_finite(list(torch.cat(g_T).to(device).split([5000, 0, 1 << 20])))
                if not (bool(got) == bool(want) == bool(got_adj) == bool(torch.cat(g_T).isfinite().all())):
                    bad.append(f"{dtype} {where} {value}: {bool(got)} vs {bool(want)}")
                checked += 1
    rep.add("ops", "dgc_all_finite equal to the C++ CPU op", not bad,
            "; ".join(bad[:4]) or f"{checked} lists (4 dtypes, NaN/±inf at the ends or none, apart and back to back)")


# --- part 1: the hashing op -------------------------------------------------------------------------------
def hash_indices(numel: int, density: float, seed: int = 0):
    """Distinct sorted-free indices at ``density`` with index 0 and the last index, plus 4 duplicates."""
    import torch

    k = max(2, int(numel * density))
    g = torch.Generator().manual_seed(seed)
    if numel <= 50_000_000:
        idx = torch.randperm(numel, generator=g)[:k]
    else:  # randperm of 214 M int64 is 1.7 GB: draw with replacement, which keeps duplicates (allowed)
        idx = torch.randint(0, numel, (k,), generator=g)
    idx[0], idx[-1] = 0, numel - 1
    if k > 8:
        idx[1:5] = idx[5]  # duplicates stay distinct entries
    return idx


def compare_grouping(got, ref, k: int) -> tuple[bool, str]:
    """Equal counts, and inside each partition the same (entry, position) pairs, whatever their order.

    Vectorized: sort each result by (partition, entry) and compare (a Python loop over 11 M entries
    would take minutes).
    """
    import torch

    counts, order, pos = (t.cpu() for t in got[:3])
    rc, ro, rp = (t.cpu() for t in ref[:3])
    if not torch.equal(counts, rc):
        return False, f"counts differ: {counts[:8].tolist()} vs {rc[:8].tolist()}"
    if not torch.equal(torch.sort(order).values, torch.arange(k)):
        return False, "not every entry exactly once"
    part = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    a = torch.argsort(part * k + order)
    b = torch.argsort(part * k + ro)
    if not (torch.equal(order[a], ro[b]) and torch.equal(pos[a], rp[b])):
        return False, "a partition holds different entries or positions"
    return True, ""


def check_hash(rep: Report, device: str, numel: int, density: float, reps: int, parts: int = 16) -> None:
    """CUDA op vs C++ CPU op (``device="cpu"``: C++ op vs the pure-torch reference)."""
    import torch

    from zen_ext import ops
    from zen_ext.ops import _reference

    if not ops.HAVE_CPP_OP:
        rep.add("hash", "C++ op built", False, "zen_ext._C did not import: run launch/setup.sh")
        return
    keys = ops.derive_keys(77)
    idx = hash_indices(numel, density)
    k = idx.numel()
    if device == "cuda":
        if not torch._C._dispatch_has_kernel_for_dispatch_key("zen_ext::hash_partition", "CUDA"):
            rep.add("hash", "CUDA kernel built", False, "zen_ext._C has no CUDA kernel: install nvcc, "
                    "ZEN_SETUP_FORCE=1 bash launch/setup.sh (docs/gpu.md)")
            return
        d_idx, d_keys = idx.cuda(), keys.cuda()

        def run(**kw):
            return torch.ops.zen_ext.hash_partition(d_idx, numel, parts, d_keys, kw.get("r", 3), kw.get("pf", 2.0),
                                                    kw.get("sf", 0.1))

        def perm(x, inverse=False):
            return torch.ops.zen_ext.permute(x.cuda(), numel, d_keys, inverse).cpu()

        t0 = time.perf_counter()
        ref = torch.ops.zen_ext.hash_partition(idx, numel, parts, keys, 3, 2.0, 0.1)
        ref_s = time.perf_counter() - t0
        ref_perm = torch.ops.zen_ext.permute(idx, numel, keys, False)
        against = "C++ CPU op"
    else:
        def run(**kw):
            return torch.ops.zen_ext.hash_partition(idx, numel, parts, keys, kw.get("r", 3), kw.get("pf", 2.0),
                                                    kw.get("sf", 0.1))

        def perm(x, inverse=False):
            return torch.ops.zen_ext.permute(x, numel, keys, inverse)

        t0 = time.perf_counter()
        ref = _reference.hash_partition(idx, numel, parts, keys)
        ref_s = time.perf_counter() - t0
        ref_perm = _reference.permute(idx, numel, keys)
        against = "pure-torch reference"
    scale = f"numel {numel:,}, K {k:,} ({density:.1%}), {parts} partitions"
    # Step 1: P and its inverse.
    y = perm(idx)
    ok = torch.equal(y, ref_perm) and torch.equal(perm(y, inverse=True), idx)
    rep.add("hash", f"P equal to the {against}, P⁻¹(P(i)) = i", ok, scale)
    edges = torch.tensor([0, numel - 1])
    rep.add("hash", "index 0 and the last index round-trip", torch.equal(perm(perm(edges), inverse=True), edges))
    # Step 2: grouping with the paper's memory (factor 2, serial 0.1).
    got = run()
    ok, why = compare_grouping(got, ref, k)
    collisions, serial, overflows = got[3].tolist()
    rep.add("hash", f"counts, entries and positions per partition equal to the {against}", ok,
            why or f"collisions {collisions:,}, serial writes {serial:,}, overflows {overflows}")
    # Step 3: forced overflow of the parallel memory (factor 0.25, no serial memory): lossless, reported.
    got = run(r=1, pf=0.25, sf=0.0)
    ok, why = compare_grouping(got, ref, k)
    collisions, serial, overflows = got[3].tolist()
    forced = device != "cuda" or overflows > 0  # the CPU path has no hash memory to overflow
    rep.add("hash", "forced overflow (parallel factor 0.25, no serial memory) stays lossless and is reported",
            ok and forced, why or f"serial writes {serial:,}, overflows {overflows:,}")
    # Step 4: time.
    if device == "cuda":
        for _ in range(3):
            run()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        rep.add("hash", "time (CUDA events)", True,
                f"median {statistics.median(times):.2f} ms, min {min(times):.2f}, max {max(times):.2f} over {reps} "
                f"(paper: 6 ms on a V100); C++ CPU op {ref_s * 1e3:.0f} ms")


# --- part 2: every scheme in SimWorld -------------------------------------------------------------------
def scheme_inputs(n: int, numel: int, dtype, device: str, seed: int = 0):
    """Integer-valued sparse gradients (sums exact in bf16 too): empty rank 1, overlap, index 0 and last."""
    import torch

    from zen_ext import SparseGrad

    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(n):
        k = 0 if r == 1 else int(numel * 0.05)
        idx = torch.randint(0, numel, (k,), generator=g)
        if k:
            idx[0], idx[-1] = 0, numel - 1
        vals = torch.randint(-3, 4, (k,), generator=g).to(dtype)
        out.append(SparseGrad(idx.to(device), vals.to(device), numel))
    return out


def check_schemes(rep: Report, device: str, ranks: list[int], numel: int = 20_011) -> None:
    import torch

    from zen_ext import SimWorld, build_scheme
    from zen_ext.core.registry import available_schemes

    for n in ranks:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            inputs = scheme_inputs(n, numel, dtype, device, seed=n)
            want = sum(x.to_dense().float() for x in inputs).to(dtype)
            for name in available_schemes():
                try:
                    outs = SimWorld(n, device=device).run(lambda c, x: build_scheme(name).sync(c, x), inputs)
                    bad = [r for r, o in enumerate(outs) if o.device.type != device or not torch.equal(o, want)]
                    rep.add("schemes", f"{name} n={n} {str(dtype)[6:]}", not bad,
                            f"ranks {bad} differ from the dense sum" if bad else "equal to the dense sum")
                except Exception as exc:  # noqa: BLE001 — a row of the report
                    rep.add("schemes", f"{name} n={n} {str(dtype)[6:]}", False, f"{type(exc).__name__}: {exc}")


# --- part 3: the Synchronizer with DGC and natural rows ----------------------------------------------------
def _sync_run(device: str, n: int, seed: int = 0):
    import torch

    from zen_ext import SimWorld
    from zen_ext.reduction.synchronizer import GradSlice, Synchronizer

    rows, width, dense_n = 300, 16, 5000
    slices = [GradSlice("emb", 0, rows * width, (rows, width)), GradSlice("w", rows * width, dense_n, (dense_n,)),
              GradSlice("b", rows * width + dense_n, 7, (7,))]
    numel = rows * width + dense_n + 7
    flats = []
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        f = torch.zeros(numel)
        hit = torch.randint(0, rows, (20,), generator=g)
        f[: rows * width].view(rows, width)[hit] = torch.randint(-3, 4, (20, width), generator=g).float()
        f[rows * width:] = torch.randn(dense_n + 7, generator=g)
        flats.append(f.to(device))
    kinds = {"emb": "natural", "w": "dgc", "b": "dense"}

    def body(comm, flat):
        s = Synchronizer(dp_comm=comm, scheme="zen", param_kinds=kinds,
                         dgc={"enabled": True, "density": 0.05, "threshold": "exact", "min_numel": 16}, natural={})
        out = [s.sync_flat(flat, slices, op="sum") for _ in range(2)]
        return out[-1]

    outs = SimWorld(n, device=device).run(body, flats)
    return outs, flats, rows * width


def check_synchronizer(rep: Report, device: str, n: int = 4) -> None:
    import torch

    try:
        outs, flats, nat = _sync_run(device, n)
        want_nat = sum(f[:nat] for f in flats)
        rep.add("synchronizer", f"natural rows equal the dense sum (n={n}, {device})",
                all(torch.equal(o[:nat], want_nat) for o in outs))
        rep.add("synchronizer", "every rank's result identical (DGC + natural + dense)",
                all(torch.equal(o, outs[0]) for o in outs) and all(o.device.type == device for o in outs))
        if device == "cuda":
            cpu, _, _ = _sync_run("cpu", n)
            close = torch.allclose(outs[0].cpu(), cpu[0], rtol=1e-5, atol=1e-6)
            rep.add("synchronizer", "CUDA result equals the same run on the CPU", close,
                    f"max |diff| {float((outs[0].cpu() - cpu[0]).abs().max()):.2e}")
    except Exception as exc:  # noqa: BLE001
        rep.add("synchronizer", "DGC + natural rows", False, f"{type(exc).__name__}: {exc}")


# --- part 4: DeepSpeed on CUDA, world size 1 ----------------------------------------------------------------
DS_DTYPES = ("fp32", "bf16", "fp16")


def _full(losses) -> str:
    """Losses at full precision (repr of the float: equal printouts mean equal values)."""
    return "[" + ", ".join(repr(v) for v in losses) + "]"


def check_deepspeed(rep: Report, steps: int = 3) -> None:
    """ZEN against dense DeepSpeed on one GPU over NCCL: bitwise equal per-step losses."""
    import logging

    import torch

    from zen_ext.comm.local import free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", str(free_port())))
    try:
        import deepspeed

        import zen_ext.deepspeed as zds
        from recipes.common import build_model
    except ImportError as exc:
        rep.add("deepspeed", "import", False, f"{exc}")
        return
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cuda":
        rep.add("deepspeed", "DeepSpeed accelerator is CUDA", False,
                f"got {get_accelerator().device_name()!r}: unset DS_ACCELERATOR (the CPU test setting)")
        return
    torch.cuda.set_device(0)
    deepspeed.init_distributed(dist_backend="nccl")
    model_cfg = os.path.join(ROOT, "configs", "models", "llama-tiny-untied.json")
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 1000, (2, 32), generator=g) for _ in range(steps)]

    def train(stage, dtype, zen=None):
        # 20000-element IPG buckets: several per step, the 64000-element embedding and head oversized.
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
               "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "torch_adam": True}},
               "zero_optimization": {"stage": stage, "overlap_comm": True, "reduce_bucket_size": 20000},
               "steps_per_print": 10**6}
        if dtype != "fp32":
            cfg[dtype] = {"enabled": True, **({"initial_scale_power": 8} if dtype == "fp16" else {})}
        if zen is not None:
            cfg["zen"] = {"bucket_cap_mb": 0.05, **zen}
        engine, *_ = zds.initialize(model=build_model(model_cfg, seed=0), config=cfg)
        losses = []
        for x in batches:
            x = x.to(engine.device)
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.float().item())
        z = getattr(engine, "zen", None)
        info = {"reductions": getattr(z, "override_calls", None)}
        if zen and zen.get("async_sync"):
            info.update(ipg=z.async_ipg_buckets, off=z.async_ipg_off)
        if z is not None and hasattr(z, "close"):
            z.close()
        return losses, info

    dgc = {"enabled": True, "density": 0.05, "min_numel": 256}
    for dtype in DS_DTYPES:
        for stage in (0, 1, 2):
            name = f"ZeRO-{stage} overlap_comm {dtype}"
            try:
                dense, _ = train(stage, dtype)
                again, _ = train(stage, dtype)
                rep.add("deepspeed", f"{name}: dense DeepSpeed repeatable (the floor)", again == dense,
                        f"dense {_full(dense)}, again {_full(again)}")
                runs = [("zen", {"scheme": "zen"}), ("auto", {"scheme": "auto"})]
                if stage in (1, 2):
                    runs.append(("zen + async_sync", {"scheme": "zen", "async_sync": True}))
                for label, zen in runs:
                    got, info = train(stage, dtype, zen)
                    ok = got == dense and (not zen.get("async_sync") or (info["ipg"] > 0 and info["off"] is None))
                    rep.add("deepspeed", f"{name}: {label} (natural only) losses equal dense DeepSpeed's", ok,
                            f"{label} {_full(got)}, {info}")
            except Exception as exc:  # noqa: BLE001
                rep.add("deepspeed", name, False, f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300])
        # DGC is lossy by design; the lossless schemes must agree on what it sends.
        try:
            ref, _ = train(1, dtype, {"scheme": "dense", "dgc": dgc})
            for scheme in ("zen", "auto"):
                got, info = train(1, dtype, {"scheme": scheme, "dgc": dgc})
                rep.add("deepspeed", f"ZeRO-1 {dtype} DGC 5 %: {scheme} equals the dense scheme on the same DGC input",
                        got == ref, f"dense scheme {_full(ref)}, {scheme} {_full(got)}")
        except Exception as exc:  # noqa: BLE001
            rep.add("deepspeed", f"ZeRO-1 {dtype} DGC", False, f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300])


# --- part 5: torch DDP (ColossalAI's TorchDDP plugin) on CUDA, world size 1 -------------------------------
def check_ddp(rep: Report, steps: int = 3) -> None:
    """ZEN's DDP comm hook against plain DDP on one GPU over NCCL, then ColossalAI's Booster plugin."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zen_ext.comm.local import free_port
    from zen_ext.engines.ddp import register_zen_hook

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT_DDP", str(free_port())))
    torch.cuda.set_device(0)
    if not dist.is_initialized():
        dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    from recipes.common import build_model

    model_cfg = os.path.join(ROOT, "configs", "models", "llama-tiny-untied.json")
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 1000, (2, 32), generator=g).cuda() for _ in range(steps)]

    def train(dtype, zen=None):
        model = build_model(model_cfg, seed=0).to(device="cuda", dtype=dtype)
        ddp = DDP(model, bucket_cap_mb=0.05)
        state = register_zen_hook(ddp, zen) if zen is not None else None
        # SGD: AdamW's eps (1e-8) is 0 in fp16 parameters, and plain DDP itself turns NaN from step 2.
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        losses = []
        for x in batches:
            loss = ddp(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.float().item())
        calls = state.hook_calls if state is not None else None
        if state is not None:
            state.close()
        return losses, calls

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        try:
            dense, _ = train(dtype)
            for scheme in ("zen", "auto"):
                got, calls = train(dtype, {"scheme": scheme, "natural": {"enabled": True}})
                finite = all(v == v and abs(v) != float("inf") for v in dense)
                rep.add("ddp", f"DDP {str(dtype)[6:]}: {scheme} hook (natural only) losses equal plain DDP's",
                        got == dense and bool(calls) and finite, f"plain {_full(dense)}, {scheme} {_full(got)}, hook calls {calls}")
        except Exception as exc:  # noqa: BLE001
            rep.add("ddp", f"DDP {str(dtype)[6:]}", False, f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300])
    try:
        import colossalai  # noqa: F401
    except ImportError:
        rep.notes.append("ddp: ColossalAI is not installed here, so its Booster was not run; its TorchDDP plugin "
                         "registers the same hook checked above (zen_ext/engines/colossalai.py)")
        return
    try:
        from colossalai.booster import Booster

        from zen_ext.engines.colossalai import ZenTorchDDPPlugin

        def boosted(zen, precision):
            # bf16: the model's own dtype (TorchDDPPlugin has no bf16 autocast: ColossalAI's
            # BF16MixedPrecision is abstract); fp16: the Booster's torch autocast with its GradScaler.
            dtype = torch.bfloat16 if precision == "bf16" else torch.float32
            model = build_model(model_cfg, seed=0).to(device="cuda", dtype=dtype)
            opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
            plugin = ZenTorchDDPPlugin(zen=zen) if zen is not None else None
            if plugin is None:
                from colossalai.booster.plugin import TorchDDPPlugin
                plugin = TorchDDPPlugin()
            booster = Booster(plugin=plugin, mixed_precision="fp16" if precision == "fp16" else None)
            model, opt, *_ = booster.boost(model, opt)
            losses = []
            for x in batches:
                loss = model(input_ids=x, labels=x).loss
                booster.backward(loss, opt)
                opt.step()
                opt.zero_grad()
                losses.append(loss.float().item())
            return losses

        for precision in (None, "bf16", "fp16"):
            label = precision or "fp32"
            dense = boosted(None, precision)
            again = boosted(None, precision)
            rep.add("ddp", f"ColossalAI Booster {label}: TorchDDPPlugin repeatable (the floor)", again == dense,
                    f"plain {_full(dense)}, again {_full(again)}")
            for scheme in ("zen", "auto"):
                got = boosted({"scheme": scheme, "natural": {"enabled": True}}, precision)
                rep.add("ddp", f"ColossalAI Booster {label}: ZenTorchDDPPlugin ({scheme}, natural only) losses equal "
                        "TorchDDPPlugin's", got == dense, f"plain {_full(dense)}, {scheme} {_full(got)}")
    except Exception as exc:  # noqa: BLE001
        rep.add("ddp", "ColossalAI Booster", False, f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300])


# --- part 6: processes sharing the GPU over gloo, and per-bucket costs ------------------------------------
def _gloo_worker(rank, world_size, device):
    import torch
    import torch.distributed as dist

    from zen_ext.comm.torch_dist import TorchCommunicator
    from zen_ext.core.registry import available_schemes
    from zen_ext.reduction.synchronizer import GradSlice, Synchronizer

    if device == "cuda":
        torch.cuda.set_device(0)
    comm = TorchCommunicator()
    inputs = scheme_inputs(world_size, 100_003, torch.float32, "cpu", seed=3)
    mine = inputs[rank]
    grad = type(mine)(mine.indices.to(device), mine.values.to(device), mine.dense_numel)
    want = mine.to_dense().clone()
    dist.all_reduce(want)
    res = {}
    for name in available_schemes():
        from zen_ext import build_scheme

        out = build_scheme(name).sync(comm, grad)
        res[name] = (out.device.type, torch.equal(out.cpu(), want))
    # Per-bucket costs: a Synchronizer bucket (natural rows + DGC + dense), host syncs and peak memory.
    rows, width, dn = 2000, 64, 200_000
    numel = rows * width + dn
    flat = torch.zeros(numel, device=device)
    g = torch.Generator().manual_seed(rank)
    hit = torch.randint(0, rows, (50,), generator=g)
    flat[: rows * width].view(rows, width)[hit.to(device)] = 1.0
    flat[rows * width:] = torch.randn(dn, generator=g).to(device)
    slices = [GradSlice("emb", 0, rows * width, (rows, width)), GradSlice("w", rows * width, dn, (dn,))]
    sync = Synchronizer(dp_comm=comm, scheme="zen", param_kinds={"emb": "natural", "w": "dgc"},
                        dgc={"enabled": True, "density": 0.01}, natural={})
    sync.sync_flat(flat, slices, op="mean")  # first layout: agreement (not the steady state)
    per = []
    for _ in range(3):
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        with HostSyncCounter(device) as hs:
            sync.sync_flat(flat, slices, op="mean")
        peak = (torch.cuda.max_memory_allocated() - base) if device == "cuda" else 0
        per.append((hs.count, peak, hs.lines))
    return res, per, flat.numel() * flat.element_size()


MAX_OWN_SYNCS = 4
"""The bound on a bucket's host synchronizations, flat in the ranks (the transport's staging aside;
tests/unit/test_bucket_host_syncs.py)."""


def _is_gloo_staging(where: str) -> bool:
    """True for a synchronizing line of the communicator that copies a payload to or from gloo's CPU
    staging buffer (``.to(...)``): NCCL takes device tensors, so these are gloo's alone."""
    path, _, line = where.rpartition(":")
    if not path.endswith(os.path.join("comm", "torch_dist.py")):
        return False
    try:
        with open(os.path.join(ROOT, path)) as f:
            text = f.read().splitlines()[int(line) - 1]
    except (OSError, ValueError, IndexError):
        return False
    return ".to(" in text


def check_gloo(rep: Report, device: str, world_size: int = 2) -> None:
    from zen_ext.comm.local import run_workers

    os.environ["ZEN_NCCL_GUARD"] = "1"  # every tensor handed to gloo must be on the CPU: staging checked
    try:
        got = run_workers(_gloo_worker, world_size, device, timeout_s=600)
    except Exception as exc:  # noqa: BLE001
        rep.add("gloo", f"{world_size} processes sharing the {device} over gloo", False, str(exc)[-400:])
        return
    for name in got[0][0]:
        ok = all(r[0][name] == (device, True) for r in got)
        rep.add("gloo", f"{name}: {world_size} processes, {device} gradients over gloo equal all_reduce", ok)
    syncs = [c for r in got for c, _, _ in r[1]]
    peaks = [p for r in got for _, p, _ in r[1]]
    from collections import Counter

    where = Counter(got[0][1][-1][2])  # rank 0's last bucket: which lines synchronized, how often
    lines = ", ".join(f"{k} ×{v}" for k, v in sorted(where.items()))
    staging = sum(v for k, v in where.items() if _is_gloo_staging(k))
    own = sum(where.values()) - staging
    rep.add("gloo", f"host synchronizations per synchronized bucket (natural + DGC + dense, zen) ≤ {MAX_OWN_SYNCS} "
            "besides gloo's staging copies", own <= MAX_OWN_SYNCS if device == "cuda" else True,
            f"{min(syncs)}–{max(syncs)} per bucket, of which {staging} are gloo's device-to-host staging copies "
            f"(absent on NCCL) and {own} zen_ext's own; rank 0 at {lines}" if device == "cuda"
            else "counted on CUDA only")
    if device == "cuda":
        rep.add("gloo", "peak GPU memory per synchronized bucket above the bucket's own", True,
                f"{max(peaks) / 2**20:.1f} MiB for a {got[0][2] / 2**20:.1f} MiB bucket")
        rep.notes.append("Over gloo every payload is staged through the CPU (gloo's device), which adds "
                         "device-to-host copies that NCCL does not have; `--multi` measures NCCL.")


# --- multi-GPU NCCL ---------------------------------------------------------------------------------------
def run_multi(rep: Report) -> None:
    import torch
    import torch.distributed as dist

    from zen_ext import build_scheme
    from zen_ext.comm.torch_dist import TorchCommunicator
    from zen_ext.core.registry import available_schemes
    from zen_ext.reduction.synchronizer import GradSlice, Synchronizer

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, n = dist.get_rank(), dist.get_world_size()
    for dtype in (torch.float32, torch.bfloat16):
        inputs = scheme_inputs(n, 1_000_003, dtype, "cpu", seed=5)
        mine = inputs[rank]
        grad = type(mine)(mine.indices.cuda(), mine.values.cuda(), mine.dense_numel)
        want = mine.to_dense().float().cuda()
        dist.all_reduce(want)
        want = want.to(dtype)
        for impl in ("p2p", "a2a"):
            comm = TorchCommunicator(exchange_impl=impl)
            for name in available_schemes():
                try:
                    out = build_scheme(name).sync(comm, grad)
                    ok = torch.tensor([float(torch.equal(out, want))], device="cuda")
                    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
                    rep.add("multi", f"{name} {impl} {str(dtype)[6:]} n={n}: equal to all_reduce", bool(ok.item()))
                except Exception as exc:  # noqa: BLE001
                    rep.add("multi", f"{name} {impl} {str(dtype)[6:]} n={n}", False, f"{type(exc).__name__}: {exc}")
    # The Synchronizer: host synchronizations and peak memory per bucket, over NCCL.
    comm = TorchCommunicator()
    rows, width, dn = 4000, 256, 4_000_000
    flat = torch.zeros(rows * width + dn, device="cuda")
    g = torch.Generator().manual_seed(rank)
    flat[: rows * width].view(rows, width)[torch.randint(0, rows, (100,), generator=g).cuda()] = 1.0
    flat[rows * width:] = torch.randn(dn, generator=g).cuda()
    slices = [GradSlice("emb", 0, rows * width, (rows, width)), GradSlice("w", rows * width, dn, (dn,))]
    sync = Synchronizer(dp_comm=comm, scheme="zen", param_kinds={"emb": "natural", "w": "dgc"},
                        dgc={"enabled": True, "density": 0.01}, natural={})
    sync.sync_flat(flat, slices, op="mean")
    counts, peaks = [], []
    for _ in range(3):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with HostSyncCounter("cuda") as hs:
            sync.sync_flat(flat, slices, op="mean")
        counts.append(hs.count)
        peaks.append(torch.cuda.max_memory_allocated() - base)
    rep.add("multi", "Synchronizer bucket over NCCL (natural + DGC 1 %)", True,
            f"host syncs {min(counts)}–{max(counts)} per bucket, peak {max(peaks) / 2**20:.1f} MiB above a "
            f"{flat.numel() * 4 / 2**20:.1f} MiB bucket (rank {rank})")
    dist.destroy_process_group()


# --- main ---------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    a = parse_args(argv)
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print(NO_GPU_MSG, file=sys.stderr)
        return 2
    rep = Report()
    if a.multi:
        if "RANK" not in os.environ:
            print("gpu_check --multi: run it under a launcher, one process per GPU: launch/gpu_check.sh --multi "
                  "or deepspeed --num_gpus N benchmarks/gpu/gpu_check.py --multi", file=sys.stderr)
            return 2
        run_multi(rep)
        if int(os.environ["RANK"]) == 0:
            _write(a.out, rep.markdown("zen_ext multi-GPU check (NCCL)", environment("cuda")))
        return 0 if rep.ok else 1
    numel = a.numel if a.device == "cuda" else min(a.numel, 200_003)
    steps = {
        "ops": lambda: check_ops(rep, a.device),
        "hash": lambda: check_hash(rep, a.device, numel, a.density, a.reps),
        "schemes": lambda: check_schemes(rep, a.device, a.sim_ranks),
        "synchronizer": lambda: check_synchronizer(rep, a.device),
        "deepspeed": lambda: check_deepspeed(rep) if a.device == "cuda" else rep.notes.append(
            "deepspeed: skipped on the CPU (the CPU engines are covered by tests/e2e)"),
        "ddp": lambda: check_ddp(rep) if a.device == "cuda" else rep.notes.append(
            "ddp: skipped on the CPU (tests/multiproc/test_ddp_hook.py covers the hook over gloo)"),
        "gloo": lambda: check_gloo(rep, a.device),
    }
    for part in a.parts:
        t0 = time.perf_counter()
        try:
            steps[part]()
        except Exception:  # noqa: BLE001 — a failed part is a failed row, the others still run
            rep.add(part, "ran", False, traceback.format_exc().strip().splitlines()[-1][:300])
        rep.notes.append(f"{part}: {time.perf_counter() - t0:.1f} s")
    rep.notes.append("One GPU cannot test multi-rank NCCL (NCCL refuses two ranks on one GPU); run "
                     "`launch/gpu_check.sh --multi` on a multi-GPU node (docs/gpu.md).")
    _write(a.out, rep.markdown("zen_ext GPU check", environment(a.device)))
    return 0 if rep.ok else 1


def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    print(f"gpu_check: report in {os.path.relpath(path, ROOT)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
