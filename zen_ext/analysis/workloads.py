"""Synthetic per-rank sparse gradients calibrated to the ZEN paper's measurements (research/seeds.md §6).

* ``embedding``: natural sparsity of an embedding table. Each rank draws ``tokens_per_rank`` tokens
  i.i.d. from Zipf(``zipf_s``) over a frequency-sorted vocabulary of ``vocab_rows`` rows (frequent tokens
  have small ids, hence the skew of paper §2.1 C3); its gradient is non-zero on the rows of those
  tokens. The defaults (V = 30522 as BERT, 600 tokens, s = 1.05) give a per-rank density of ~1.06 % and
  ~40.8 % after 128 ranks — BERT on SQuAD in the thesis (Table 3.1, §3.3.1); γ = 1.7, 3.1, 5.4, 9.2,
  15.3, 24.3, 37.1 for n = 2 … 128, ≥ 60 % of the non-zeros in the first of 8 ranges.
* ``dgc``: DGC-like top-k of dense gradients. The bucket holds ``num_tensors`` tensors whose scales are
  log-uniform over ``scale_decades`` decades (SAFusion: magnitudes differ per layer); each rank's
  gradient is ``√ρ·shared + √(1−ρ)·own`` with Laplace components, so the ranks' top-k sets overlap
  partially (γⁿ ≪ n) and cluster in the large-scale tensors; a global top ``density`` fraction of the
  bucket is kept, as DGC does per bucket.

Rank ``r``'s gradient depends only on ``(seed, r)``, not on ``n``: the first ``k`` ranks of a run with
``n`` ranks are the run with ``k`` ranks, so curves over ``n`` are nested like the paper's.

Only the index pattern drives communication costs. Values are small integers by default, so every
lossless scheme must reproduce the dense sum exactly (``integer_values=False`` gives real-valued ones).

Forms: ``"element"`` (default) expands each non-zero row into its ``row_width`` elements — the COO
element format the paper's cost model and ZEN's GPU kernel use; ``"row"`` keeps one index per row.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..core.types import SparseGrad

FORMS = ("element", "row")
_zipf_cache: dict[tuple[int, float], torch.Tensor] = {}


def _rank_generator(seed: int, rank: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed) * 1_000_003 + int(rank) + 1)


def _zipf_weights(vocab_rows: int, zipf_s: float) -> torch.Tensor:
    key = (vocab_rows, zipf_s)
    if key not in _zipf_cache:
        _zipf_cache[key] = torch.arange(1, vocab_rows + 1, dtype=torch.float64).pow(-zipf_s)
    return _zipf_cache[key]


def _check(name: str, value, ok: bool, rule: str) -> None:
    if not ok:
        raise ValueError(f"workload.{name} ({value!r}) must {rule}")


def _rows_to_form(rows_K: torch.Tensor, vals_KW: torch.Tensor, num_rows: int, form: str) -> SparseGrad:
    if form == "row":
        return SparseGrad(rows_K, vals_KW, num_rows)
    w = vals_KW.shape[1]
    idx = (rows_K.unsqueeze(1) * w + torch.arange(w)).reshape(-1)
    return SparseGrad(idx, vals_KW.reshape(-1), num_rows * w)


def zipf_embedding(
    n: int,
    *,
    vocab_rows: int = 30522,
    tokens_per_rank: int = 600,
    zipf_s: float = 1.05,
    row_width: int = 64,
    form: str = "element",
    coalesce: bool = True,
    integer_values: bool = True,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> list[SparseGrad]:
    """Embedding-row gradients of ``n`` ranks (see the module docstring).

    Args:
        n: number of ranks.
        vocab_rows: rows of the table (BERT: 30522).
        tokens_per_rank: tokens in one rank's batch (BERT SQuAD batch 4 ≈ 600 tokens after padding).
        zipf_s: Zipf exponent of token frequencies.
        row_width: elements per row (BERT: 768; smaller keeps a 128-rank simulation in memory, and
            every byte count but the per-message headers scales linearly with it).
        form: ``"element"`` or ``"row"``.
        coalesce: ``True``: one entry per distinct row, as the non-zero rows of a dense gradient bucket;
            ``False``: one entry per token, duplicates included, as ``nn.Embedding(sparse=True)`` and
            TF ``IndexedSlices`` produce them (schemes must sum them).
        integer_values: values in 1…8 (exact sums) instead of standard normal ones.
        dtype: value dtype.
        seed: workload seed.
    """
    _check("n", n, isinstance(n, int) and n >= 1, "be an int >= 1")
    _check("vocab_rows", vocab_rows, vocab_rows >= 1, "be >= 1")
    _check("tokens_per_rank", tokens_per_rank, tokens_per_rank >= 0, "be >= 0")
    _check("zipf_s", zipf_s, zipf_s > 0, "be > 0")
    _check("row_width", row_width, isinstance(row_width, int) and row_width >= 1, "be an int >= 1")
    _check("form", form, form in FORMS, f"be one of {list(FORMS)}")
    weights = _zipf_weights(vocab_rows, float(zipf_s))
    out = []
    for r in range(n):
        g = _rank_generator(seed, r)
        tokens = torch.multinomial(weights, tokens_per_rank, replacement=True, generator=g) if tokens_per_rank \
            else torch.empty(0, dtype=torch.int64)
        if integer_values:
            vals = torch.randint(1, 9, (tokens.numel(), row_width), generator=g).to(dtype)
        else:
            vals = torch.randn(tokens.numel(), row_width, generator=g).to(dtype)
        if coalesce:
            rows, inv = torch.unique(tokens, sorted=True, return_inverse=True)
            summed = torch.zeros(rows.numel(), row_width, dtype=torch.float64).index_add_(0, inv, vals.double())
            tokens, vals = rows, summed.to(dtype)
        out.append(_rows_to_form(tokens, vals, vocab_rows, form))
    return out


def dgc_topk(
    n: int,
    *,
    numel: int = 1 << 21,
    density: float = 0.01,
    shared_fraction: float = 0.5,
    num_tensors: int = 16,
    scale_decades: float = 2.0,
    integer_values: bool = True,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> list[SparseGrad]:
    """DGC-like top-k gradients of ``n`` ranks over one ``numel``-element bucket (see the module docstring).

    Args:
        n: number of ranks.
        numel: bucket size in elements.
        density: fraction kept by top-k on every rank (DGC: 0.1 %–5 %; ZEN's LLM runs: 5 %).
        shared_fraction: ``ρ``, the variance share of the component common to all ranks (0: unrelated
            ranks, γⁿ → n; 1: identical top-k sets, γⁿ = 1).
        num_tensors: tensors in the bucket, each with its own scale.
        scale_decades: tensor scales are log-uniform over this many decades.
        integer_values: values ``±1…8`` with the gradient's sign (exact sums) instead of the gradient.
        dtype: value dtype.
        seed: workload seed.
    """
    _check("n", n, isinstance(n, int) and n >= 1, "be an int >= 1")
    _check("numel", numel, isinstance(numel, int) and numel >= 1, "be an int >= 1")
    _check("density", density, 0 < density <= 1, "be in (0, 1]")
    _check("shared_fraction", shared_fraction, 0 <= shared_fraction <= 1, "be in [0, 1]")
    _check("num_tensors", num_tensors, isinstance(num_tensors, int) and 1 <= num_tensors <= numel,
           f"be an int in [1, {numel}]")
    k = max(1, int(round(density * numel)))
    out = []
    for r, (grad, g) in enumerate(_dgc_dense(range(n), numel, shared_fraction, num_tensors, scale_decades, seed)):
        idx = torch.topk(grad.abs(), k, sorted=False).indices.sort().values
        if integer_values:
            vals = torch.randint(1, 9, (k,), generator=g).double() * grad[idx].sign()
        else:
            vals = grad[idx]
        out.append(SparseGrad(idx, vals.to(dtype), numel))
    return out


def dgc_dense(ranks, *, numel: int = 1 << 21, shared_fraction: float = 0.5, num_tensors: int = 16,
              scale_decades: float = 2.0, dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.Tensor]:
    """The dense gradients ``dgc_topk`` (same arguments) selects from, of ``ranks`` only: a rank's does not
    depend on the others, so a process builds just its own (what a self-selecting scheme such as
    ``spardl`` is handed, next to the ``dgc_topk`` entries DGC would hand ZEN)."""
    return [grad.to(dtype) for grad, _ in _dgc_dense(ranks, numel, shared_fraction, num_tensors, scale_decades, seed)]


def _dgc_dense(ranks, numel: int, shared_fraction: float, num_tensors: int, scale_decades: float, seed: int):
    """Yield ``(rank's dense float64 gradient, the rank's generator)``: the generator continues into the
    integer values ``dgc_topk`` draws."""
    shared_g = _rank_generator(seed, -1)
    bounds = torch.linspace(0, numel, num_tensors + 1).long()
    scale = torch.empty(numel, dtype=torch.float64)
    tensor_scales = torch.pow(10.0, torch.rand(num_tensors, generator=shared_g, dtype=torch.float64) * scale_decades)
    for t in range(num_tensors):
        scale[bounds[t]:bounds[t + 1]] = tensor_scales[t]
    shared = _laplace(numel, shared_g)
    for r in ranks:
        g = _rank_generator(seed, r)
        yield scale * (shared_fraction ** 0.5 * shared + (1 - shared_fraction) ** 0.5 * _laplace(numel, g)), g


def _laplace(numel: int, g: torch.Generator) -> torch.Tensor:
    mag = torch.empty(numel, dtype=torch.float64).exponential_(generator=g)
    return torch.where(torch.rand(numel, generator=g, dtype=torch.float64) < 0.5, -mag, mag)


WORKLOADS: dict[str, Callable[..., list[SparseGrad]]] = {"embedding": zipf_embedding, "dgc": dgc_topk}


def build_workload(name: str, n: int, **options) -> list[SparseGrad]:
    """``WORKLOADS[name](n, **options)``.

    Raises:
        ValueError: unknown workload (lists the valid ones).
    """
    if name not in WORKLOADS:
        raise ValueError(f"workload ({name!r}) must be one of {sorted(WORKLOADS)}")
    return WORKLOADS[name](n, **options)
