"""Natural sparsity: embedding detection (tied, vocab-parallel, HF), and lossless sync equal to dense."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from zen_ext import SimWorld, build_scheme
from zen_ext.compress import NamedGrad, NaturalConfig, NaturalSparsifier, classify_parameters
from zen_ext.reduction.synchronizer import GradSlice, Synchronizer


# --- the sparsifier ---------------------------------------------------------------------------------
def test_row_form_sends_only_nonzero_rows():
    g = torch.zeros(10, 4)
    g[0, 1], g[9] = 2.0, torch.tensor([1.0, -1.0, 0.0, 3.0])
    sg = NaturalSparsifier().compress([NamedGrad("emb", g)])
    assert sg.indices.tolist() == [0, 9] and sg.numel == 10 and sg.row_width == 4
    assert torch.equal(sg.to_dense(), g.reshape(-1))


def test_element_form_when_row_granularity_is_off():
    g = torch.zeros(10, 4)
    g[3, 2] = 5.0
    sg = NaturalSparsifier(NaturalConfig(row_granularity=False)).compress([NamedGrad("emb", g)])
    assert sg.indices.tolist() == [14] and sg.values.tolist() == [5.0] and sg.numel == 40


def test_config_errors():
    with pytest.raises(ValueError, match=r"zen.natural got unknown key\(s\) \['rows'\]; valid keys are \['enabled', 'row_granularity'\]"):
        NaturalConfig.from_dict({"rows": True})
    with pytest.raises(TypeError, match=r"zen.natural.row_granularity \(1\) must be a bool"):
        NaturalConfig.from_dict({"row_granularity": 1})


# --- classify_parameters ----------------------------------------------------------------------------
class TinyLM(nn.Module):
    def __init__(self, tied: bool, vocab: int = 100, width: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(16, width)
        self.norm = nn.LayerNorm(width)
        self.proj = nn.Linear(width, width)
        self.small = nn.Linear(4, 4)
        self.head = nn.Linear(width, vocab, bias=False)
        self.frozen = nn.Parameter(torch.zeros(64, 64), requires_grad=False)
        if tied:
            self.head.weight = self.embed.weight


def test_classify_untied_and_tied(caplog):
    dgc = {"enabled": True, "min_numel": 512}
    kinds = classify_parameters(TinyLM(tied=False), natural={}, dgc=dgc)
    assert kinds == {
        "embed.weight": "natural", "pos.weight": "natural", "norm.weight": "dense", "norm.bias": "dense",
        "proj.weight": "dgc", "proj.bias": "dense", "small.weight": "dense", "small.bias": "dense",
        "head.weight": "dgc",
    }
    with caplog.at_level(logging.INFO, logger="zen_ext.compress.routing"):
        tied = classify_parameters(TinyLM(tied=True), natural={}, dgc=dgc)
        classify_parameters(TinyLM(tied=True), natural={}, dgc=dgc)
    assert tied["embed.weight"] == "dgc" and "head.weight" not in tied  # one Parameter, one name
    msgs = [r.getMessage() for r in caplog.records if "tied" in r.getMessage()]
    assert msgs == ["zen: embedding 'embed.weight' is tied to an output layer (its gradient is dense); routing it 'dgc'"]
    assert classify_parameters(TinyLM(tied=True), natural={}, dgc=None, log=False)["embed.weight"] == "dense"


def test_classify_with_sparsifiers_disabled():
    off = classify_parameters(TinyLM(tied=False), natural=None, dgc=None, log=False)
    assert set(off.values()) == {"dense"}
    nat_off = classify_parameters(TinyLM(tied=False), natural={"enabled": False}, dgc={"enabled": True, "min_numel": 600},
                                  log=False)
    assert nat_off["embed.weight"] == "dgc" and nat_off["pos.weight"] == "dense"  # 16·32 < 600


def test_classify_dense_params_keeps_matching_parameters_dense():
    """``dgc.dense_params`` routes matching names dense (e.g. the output layer); the rest is unchanged."""
    dgc = {"enabled": True, "min_numel": 512}
    base = classify_parameters(TinyLM(tied=False), natural={}, dgc=dgc, log=False)
    kept = classify_parameters(TinyLM(tied=False), natural={}, dgc=dict(dgc, dense_params=["^head\\."]), log=False)
    assert base["head.weight"] == "dgc" and kept["head.weight"] == "dense"
    assert {k: v for k, v in kept.items() if k != "head.weight"} == {k: v for k, v in base.items() if k != "head.weight"}
    # A pattern that matches an embedding does not take it off its natural path: naturally sparse is lossless.
    assert classify_parameters(TinyLM(tied=False), natural={}, dgc=dict(dgc, dense_params=["embed"]),
                               log=False)["embed.weight"] == "natural"
    with pytest.raises(ValueError, match=r"zen.dgc.dense_params \('\['\) must be a valid regular expression"):
        classify_parameters(TinyLM(tied=False), natural={}, dgc=dict(dgc, dense_params=["["]), log=False)
    with pytest.raises(TypeError, match=r"zen.dgc.dense_params \('head'\) must be a list"):
        classify_parameters(TinyLM(tied=False), natural={}, dgc=dict(dgc, dense_params="head"), log=False)


class VocabParallelEmbedding1D(nn.Module):
    """Shaped like ColossalAI's vocab-parallel shard: not an nn.Embedding, own [rows, width] weight."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(50, 8))


class RotaryEmbedding(nn.Module):  # an "Embedding" without a weight: not an embedding table
    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.ones(4))
        self.scale = nn.Parameter(torch.ones(4))


def test_classify_vocab_parallel_shards_and_embedding_bag():
    model = nn.ModuleDict({"vp": VocabParallelEmbedding1D(), "bag": nn.EmbeddingBag(30, 8), "rope": RotaryEmbedding()})
    kinds = classify_parameters(model, natural={}, dgc={"enabled": True, "min_numel": 1}, log=False)
    assert kinds == {"vp.weight": "natural", "bag.weight": "natural", "rope.scale": "dense"}


@pytest.mark.parametrize("tie", [False, True])
def test_classify_hf_model(tie):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=1, n_head=2,
                                  tie_word_embeddings=tie)
    model = transformers.GPT2LMHeadModel(cfg)
    kinds = classify_parameters(model, natural={}, dgc={"enabled": True, "min_numel": 1024}, log=False)
    assert kinds["transformer.wte.weight"] == ("dgc" if tie else "natural")
    assert kinds["transformer.wpe.weight"] == "natural"
    assert kinds["transformer.h.0.attn.c_attn.weight"] == "dgc"
    assert kinds["transformer.h.0.ln_1.weight"] == "dense"
    assert ("lm_head.weight" in kinds) == (not tie)


# --- lossless through the Synchronizer --------------------------------------------------------------
def embedding_grads(n, rows, width, case, dtype, seed=0):
    """One [rows, width] gradient per rank with integer values; ``case`` picks the row sets."""
    gen = torch.Generator().manual_seed(seed)
    all_rows = torch.arange(rows)
    sets = {
        "random": [torch.randint(0, rows, (rows // 5,), generator=gen) for _ in range(n)],
        "empty_ranks": [torch.tensor([0, rows - 1]) if r % 2 == 0 else torch.empty(0, dtype=torch.int64)
                        for r in range(n)],
        "full_overlap": [all_rows[3:40]] * n,
        "no_overlap": [all_rows[r::n] for r in range(n)],
        "dense": [all_rows] * n,
    }[case]
    out = []
    for idx in sets:
        g = torch.zeros(rows, width)
        g.index_add_(0, idx, torch.randint(-8, 9, (idx.numel(), width), generator=gen).float())  # duplicates sum
        out.append(g.to(dtype))
    return out


def sync_natural(grads, op, scheme, row_granularity=True, extra_dense=0):
    n, (rows, width) = len(grads), grads[0].shape
    slices = [GradSlice("emb", 0, rows * width, (rows, width))]
    flats = [torch.cat([g.reshape(-1), torch.full((extra_dense,), float(r + 1), dtype=g.dtype)])
             for r, g in enumerate(grads)]

    def fn(comm, flat):
        sync = Synchronizer(dp_comm=comm, scheme=build_scheme(scheme), param_kinds={"emb": "natural"},
                            natural={"row_granularity": row_granularity})
        return sync.sync_flat(flat, slices, op), sync.pop_step_stats()

    world = SimWorld(n)
    return world.run(fn, flats), flats, world


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("case", ["random", "empty_ranks", "full_overlap", "no_overlap", "dense"])
@pytest.mark.parametrize("row_granularity", [True, False])
def test_natural_equals_dense_allreduce_exactly(n, case, row_granularity):
    grads = embedding_grads(n, rows=97, width=6, case=case, dtype=torch.float32, seed=n)
    for op in ("sum", "mean"):
        out, flats, _ = sync_natural(grads, op, "zen", row_granularity, extra_dense=7)
        want = SimWorld(n).run(lambda c, x: build_scheme("dense").sync(c, x, op=op), flats)
        for r in range(n):
            assert torch.equal(out[r][0], want[r]), (case, op, r)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_natural_half_precision(dtype):
    grads = embedding_grads(4, rows=64, width=8, case="random", dtype=dtype)
    out, flats, _ = sync_natural(grads, "sum", "zen")
    want = sum(f.float() for f in flats)  # small integers: exact in every dtype
    for o, _stats in out:
        assert o.dtype == dtype and torch.equal(o.float(), want)
    out, flats, _ = sync_natural(grads, "mean", "zen")
    for o, _stats in out:
        torch.testing.assert_close(o.float(), want / 4, rtol=1e-2, atol=1e-2)


def zipf_embedding_grads(n, rows, width, tokens, seed=0):
    """Token ids drawn from a Zipf(1.1) law over ``rows``: a few hot rows on every rank, a long tail."""
    gen = torch.Generator().manual_seed(seed)
    p = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** 1.1
    out = []
    for _ in range(n):
        ids = torch.multinomial(p, tokens, replacement=True, generator=gen)
        g = torch.zeros(rows, width)
        g.index_add_(0, ids, torch.randn(tokens, width, generator=gen))
        out.append(g)
    return out


def test_row_granularity_sends_fewer_bytes_on_a_zipf_workload():
    grads = zipf_embedding_grads(4, rows=5000, width=16, tokens=1024)
    sent = {}
    for rows in (True, False):
        out, flats, world = sync_natural(grads, "mean", "zen", row_granularity=rows)
        sent[rows] = max(s.bytes_sent for s in world.stats)
        torch.testing.assert_close(out[0][0], sum(flats) / 4)
        assert out[0][1]["bytes_sent"] == world.stats[0].bytes_sent
    # Push: element form pays a 4-byte index per element, row form one per row of 16 (8 → 4.25 bytes
    # per element); Pull is value-dominated in both (hash bitmap), so the total drops by about 1/4.
    assert sent[True] * 1.25 < sent[False], sent
