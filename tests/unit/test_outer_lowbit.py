"""zen.outer with contributors counted at ZEN's owners and ``value_bits`` (8 or 4): replicas bitwise equal
after each outer step, what quantization loses stays in the error feedback, bytes against fp32 and
against the (value, 1) rows, and the refusals (schemes that cannot carry low bits, bad values)."""

from __future__ import annotations

import logging

import pytest
import torch

from zen_ext.comm.simulated import SimWorld
from zen_ext.config import ZenConfig
from zen_ext.outer import OuterSync

SHAPES = [(5, 30), (64,), (3,), (7, 11)]
SMALL = dict(enabled=True, every=2, density=4 / 64, chunk=64, error_decay=0.9)


def _named(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(f"p{i}", torch.nn.Parameter(torch.randn(s, generator=g))) for i, s in enumerate(SHAPES)]


def _rounds(n: int, cfg: dict, rounds: int = 3, scheme: str = "zen"):
    """Every replica moves its parameters by its own noise, then an outer step; per rank the OuterSync,
    the parameters after each round and the bytes sent."""

    def body(comm):
        named = _named(0)
        outer = OuterSync(named, comm, cfg, scheme=scheme, bucket_cap_mb=1e-3)
        after = []
        for rnd in range(rounds):
            g = torch.Generator().manual_seed(1000 * rnd + comm.rank)
            with torch.no_grad():
                for _, p in named:
                    p.add_(torch.randn(p.shape, generator=g) * 0.1)
            assert outer.maybe_step((rnd + 1) * outer.cfg.every)
            after.append(torch.cat([p.detach().reshape(-1).clone() for _, p in named]))
        return outer, after, outer.pop_stats()

    return SimWorld(n).run(body)


@pytest.mark.parametrize("scheme", ["zen", "zen_coo"])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("average", ["contributors", "mean"])
def test_replicas_bitwise_equal_with_low_bit_values(scheme, bits, n, average):
    cfg = dict(SMALL, value_bits=bits, average=average, momentum=0.9, nesterov=True, lr=0.7)
    res = _rounds(n, cfg, scheme=scheme)
    for rnd in range(3):
        assert all(torch.equal(after[rnd], res[0][1][rnd]) for _, after, _ in res[1:])
    assert not torch.equal(res[0][1][0], _rounds(n, dict(cfg, value_bits=None), rounds=1, scheme=scheme)[0][1][0])


@pytest.mark.parametrize("bits", [8, 4])
def test_quantization_loss_stays_in_the_error_feedback(bits):
    """One outer step from e = 0: the error feedback after it is Δ minus what reached the owners (the
    dequantized picks): at the picks, pick − dequantized (non-zero, within half a quantization step of
    the pick's block); elsewhere Δ itself."""
    n = 3
    cfg = dict(SMALL, value_bits=bits, error_decay=0.5)
    seen = {}

    class Spy(OuterSync):
        def _sparse_sum(self, i, b, idx_K, val_K):
            out = super()._sparse_sum(i, b, idx_K, val_K)
            seen.setdefault(self.comm.rank, []).append((idx_K.clone(), val_K.clone(), b.err_N.clone()))
            return out

    def body(comm):
        named = _named(0)
        outer = Spy(named, comm, cfg, bucket_cap_mb=1e-3)
        theta = torch.cat([p.detach().reshape(-1).clone() for _, p in named])
        g = torch.Generator().manual_seed(comm.rank)
        with torch.no_grad():
            for _, p in named:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
        local = torch.cat([p.detach().reshape(-1).clone() for _, p in named])
        outer.maybe_step(outer.cfg.every)
        return theta - local

    deltas = SimWorld(n).run(body)
    qmax = 127 if bits == 8 else 7
    for r in range(n):
        at = 0
        for idx, val, err in seen[r]:
            delta = deltas[r][at:at + err.numel()]
            at += err.numel()
            lost = err[idx]
            assert lost.abs().max() > 0
            assert lost.abs().max() <= val.abs().max() / qmax / 2 * (1 + 1e-5)
            rest = torch.ones_like(err, dtype=torch.bool)
            rest[idx] = False
            assert torch.equal(err[rest], delta[rest])  # what was not picked is Δ itself (e was 0)


def test_counted_contributors_send_the_bytes_of_mean_and_low_bits_fewer():
    """Counted at the owners, "contributors" sends exactly what "mean" sends; 8 and 4 bits less."""
    n = 4
    cfg = dict(SMALL, density=8 / 64)

    def sent(**kw):
        return sum(st["bytes_sent"] for _, _, st in _rounds(n, dict(cfg, **kw), rounds=1))
    fp32_mean, counted = sent(average="mean"), sent(average="contributors")
    assert counted == fp32_mean
    assert sent(average="contributors", value_bits=8) < 0.7 * counted
    assert sent(average="contributors", value_bits=4) < sent(average="contributors", value_bits=8)


def test_row_form_fallback_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="zen_ext.outer.average"):
        res = _rounds(2, dict(SMALL), rounds=1, scheme="agsparse")
    assert res[0][0].form == "rows"
    assert "does not count the senders of each index; average 'contributors' sends each pick as a (value, 1) " \
           "row" in caplog.text


@pytest.mark.parametrize("scheme", ["agsparse", "sparcml", "auto"])
def test_value_bits_refused_without_a_zen_scheme(scheme):
    with pytest.raises(RuntimeError, match=rf"zen.outer.value_bits \(4\) must be unset with zen.scheme \('{scheme}'\): "
                                           r"only ZEN schemes carry the outer picks in low bits \(zen, zen_coo\)"):
        SimWorld(1).run(lambda c: OuterSync(_named(0), c, dict(SMALL, value_bits=4), scheme=scheme))


@pytest.mark.parametrize("section, text", [
    ({"value_bits": 3}, "zen.outer.value_bits (3) must be one of [8, 4] or unset"),
    ({"value_bits": True}, "zen.outer.value_bits (True) must be one of [8, 4] or unset"),
    ({"value_bits": 4, "density": 1}, "zen.outer.value_bits (4) must be unset with zen.outer.density 1"),
])
def test_value_bits_config_errors(section, text):
    with pytest.raises(ValueError) as info:
        ZenConfig.from_dict({"outer": section})
    assert str(info.value).startswith(text)


def test_recipe_flag_fills_value_bits(tmp_path):
    import json

    from recipes.common import ConfigError
    from recipes.finetune_llm import load_ds_config, parse_args

    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zen": {"scheme": "zen"}}))
    args = parse_args(["--deepspeed_config", str(cfg), "--outer_every", "5", "--outer_value_bits", "4",
                       "--output_dir", str(tmp_path)])
    assert load_ds_config(args)["zen"]["outer"] == {"enabled": True, "every": 5, "value_bits": 4}
    bad = parse_args(["--deepspeed_config", str(cfg), "--outer_every", "5", "--outer_value_bits", "2",
                      "--output_dir", str(tmp_path)])
    with pytest.raises(ConfigError, match=r"zen.outer.value_bits \(2\) must be one of \[8, 4\] or unset"):
        load_ds_config(bad)


def test_value_bits_with_another_scheme_refused_by_the_config():
    with pytest.raises(ValueError, match=r"zen.outer.value_bits \(8\) must be unset with zen.scheme \('agsparse'\)"):
        ZenConfig.from_dict({"scheme": "agsparse", "outer": {"enabled": True, "value_bits": 8}})
    assert ZenConfig.from_dict({"scheme": "zen", "outer": {"enabled": True, "value_bits": 8}}).outer.value_bits == 8
