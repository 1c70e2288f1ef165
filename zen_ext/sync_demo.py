"""``python -m zen_ext sync``: ZEN synchronizing a real embedding gradient on local gloo processes.

Each rank embeds a different slice of real text (the Zen of Python and the stdlib's own docstrings,
so it runs offline), back-propagates a small language-model loss, and synchronizes the naturally
sparse embedding gradient (only the rows of the batch's tokens are non-zero) with ``zen`` and with a
dense all-reduce. It prints per-rank bytes and checks that both results are equal, twice:

1. exactly, on an integer-valued gradient with the same non-zero rows (``op="sum"``): integers up to
   2**24 add exactly in fp32 in any order, so any difference is a bug, not rounding;
2. on the real fp32 gradient (``op="mean"``): ZEN adds each row on the rank that owns it, the dense
   all-reduce in its own order, so the results may differ by float rounding of the summation order
   (a few units in the last place); "equal" there means within ``FLOAT_RTOL`` of the largest value.
"""

from __future__ import annotations

import argparse
import os
import re

FLOAT_RTOL = 1e-6
"""Largest |ZEN − dense| accepted on the fp32 gradient, relative to its largest |value| (fp32's
epsilon is 1.2e-7; the summation order changes a sum of n terms by a few of them)."""


def _corpus_words() -> list[str]:
    import codecs
    import contextlib
    import io
    import pydoc

    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the poem
        import this
    text = codecs.decode(this.s, "rot13")
    for mod in ("json", "argparse", "collections", "functools", "pathlib", "itertools", "typing", "logging",
                "unittest", "subprocess", "threading", "email", "http", "sqlite3", "decimal", "datetime"):
        text += "\n" + (pydoc.getdoc(__import__(mod)) or "")
    return re.findall(r"[A-Za-z]+", text.lower())


def _worker(rank: int, world_size: int, vocab: int, width: int, tokens: int, scheme: str) -> dict:
    import torch

    from zen_ext import SparseGrad, build_scheme
    from zen_ext.comm.torch_dist import TorchCommunicator

    words = _corpus_words()
    # A stable word → row mapping shared by every rank (Python's hash() is salted per process).
    import zlib

    ids = torch.tensor([zlib.crc32(w.encode()) % vocab for w in words])
    batch = ids[rank * tokens % len(ids):][:tokens]
    torch.manual_seed(0)
    emb = torch.nn.Embedding(vocab, width)
    head = torch.nn.Linear(width, vocab)
    loss = torch.nn.functional.cross_entropy(head(emb(batch[:-1])), batch[1:])
    loss.backward()
    grad = emb.weight.grad  # rows of unseen tokens are exactly zero
    comm = TorchCommunicator()
    sparse = SparseGrad.from_dense_rows(grad)
    comm.stats.reset()
    out_zen = build_scheme(scheme).sync(comm, sparse, op="mean")
    zen_stats = comm.stats.snapshot()
    comm.stats.reset()
    out_dense = build_scheme("dense").sync(comm, grad.reshape(-1), op="mean")
    dense_stats = comm.stats.snapshot()
    # The exact check: the same non-zero rows with small integer values, summed.
    g = torch.Generator().manual_seed(rank)
    ints = torch.randint(1, 9, grad.shape, generator=g).float() * (grad != 0).any(dim=1, keepdim=True)
    int_zen = build_scheme(scheme).sync(comm, SparseGrad.from_dense_rows(ints), op="sum")
    int_dense = build_scheme("dense").sync(comm, ints.reshape(-1), op="sum")
    return dict(rank=rank, rows=sparse.nnz, density=sparse.nnz / vocab,
                zen_sent=zen_stats.bytes_sent, zen_recv=zen_stats.bytes_recv,
                dense_sent=dense_stats.bytes_sent, dense_recv=dense_stats.bytes_recv,
                max_abs_diff=float((out_zen - out_dense).abs().max()),
                max_abs=float(out_dense.abs().max()), int_equal=bool(torch.equal(int_zen, int_dense)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m zen_ext sync", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4, help="local gloo processes (default 4)")
    p.add_argument("--vocab", type=int, default=30522, help="embedding rows (default 30522, BERT's)")
    p.add_argument("--width", type=int, default=64, help="embedding width (default 64)")
    p.add_argument("--tokens", type=int, default=600, help="tokens per rank (default 600)")
    p.add_argument("--scheme", default="zen", help="scheme to compare with dense (default zen)")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from zen_ext.comm.local import run_workers

    res = run_workers(_worker, args.ranks, args.vocab, args.width, args.tokens, args.scheme)
    print(f"{args.scheme} vs dense all-reduce of a {args.vocab}×{args.width} embedding gradient, {args.ranks} ranks")
    print(f"{'rank':>4} {'rows':>6} {'density':>8} {'sent MB':>8} {'dense MB':>9} {'ratio':>6} {'max|diff|':>10}")
    for r in res:
        print(f"{r['rank']:>4} {r['rows']:>6} {r['density']:>8.2%} {r['zen_sent'] / 1e6:>8.3f} "
              f"{r['dense_sent'] / 1e6:>9.3f} {r['dense_sent'] / max(r['zen_sent'], 1):>5.1f}x {r['max_abs_diff']:>10.2e}")
    exact = all(r["int_equal"] for r in res)
    worst = max(r["max_abs_diff"] for r in res)
    rel = worst / max(max(r["max_abs"] for r in res), 1e-30)
    close = rel <= FLOAT_RTOL
    print(f"integer-valued gradient (same rows, sum): bitwise equal to dense all-reduce: {'yes' if exact else 'NO'}")
    print(f"real fp32 gradient (mean): max |diff| {worst:.2e} = {rel:.1e} of the largest value: "
          f"{'equal up to float summation order' if close else 'NOT equal'} (rtol {FLOAT_RTOL:g}; ZEN sums each row "
          f"on its owner, the all-reduce in its own order)")
    return 0 if exact and close else 1
