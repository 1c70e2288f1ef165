"""``zen_ext.optim.CatchUpAdamW``: AdamW where every coordinate has a gradient; a held-back coordinate
catches up by the steps it missed."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from recipes import common, finetune_llm
from zen_ext.config import ZenConfig
from zen_ext.optim import CatchUpAdamW, catch_up_param_groups

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KW = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01, eps=1e-8)


def test_equals_torch_adamw_when_every_coordinate_has_a_gradient():
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(64))
    b = torch.nn.Parameter(a.detach().clone())
    opt_a, opt_b = torch.optim.AdamW([a], foreach=False, **KW), CatchUpAdamW([b], **KW)
    for _ in range(12):
        g = torch.randn(64)
        a.grad, b.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    torch.testing.assert_close(b.detach(), a.detach(), rtol=0, atol=1e-6)
    assert not torch.equal(a.detach(), torch.zeros(64))


def test_a_zero_gradient_waits_and_a_burst_counts_as_the_steps_it_stood_for():
    """A coordinate held back for k − 1 steps and then sent as G (error feedback's burst) moves nothing
    meanwhile; then, momentum-free (b1 = 0, wd = 0, fresh state), m = G/k, v̂ = G²/k and the weight moves
    k·lr·(G/k)/sqrt(G²/k) = sqrt(k)·lr·sign(G): as far as dense AdamW's random walk over k gradients of
    independent signs. Plain AdamW moves the same burst by lr·sqrt((1 − b2^k)/(1 − b2)) whatever k is."""
    k, lr, b2 = 16, 0.01, 0.95
    kw = dict(lr=lr, betas=(0.0, b2), weight_decay=0.0, eps=1e-12)
    burst_g = torch.tensor([0.5, -2.0, 3.0])
    burst = torch.nn.Parameter(torch.zeros(3))
    opt = CatchUpAdamW([burst], **kw)
    for t in range(k):
        burst.grad = torch.zeros(3) if t < k - 1 else burst_g.clone()
        opt.step()
        if t < k - 1:  # held back: nothing moves, the moments wait
            assert torch.equal(burst.detach(), torch.zeros(3))
            assert torch.equal(opt.state[burst]["exp_avg"], torch.zeros(3))
            assert opt.state[burst]["age"].tolist() == [t + 1.0] * 3
    torch.testing.assert_close(burst.detach(), -(k ** 0.5) * lr * burst_g.sign(), rtol=1e-5, atol=0)
    torch.testing.assert_close(opt.state[burst]["exp_avg_sq"], (1 - b2 ** k) * burst_g.square() / k)
    assert torch.equal(opt.state[burst]["age"], torch.zeros(3))  # reset where sent
    plain = torch.nn.Parameter(torch.zeros(3))
    opt_p = torch.optim.AdamW([plain], foreach=False, **kw)
    for t in range(k):
        plain.grad = torch.zeros(3) if t < k - 1 else burst_g.clone()
        opt_p.step()
    torch.testing.assert_close(plain.detach(), -lr * ((1 - b2 ** k) / (1 - b2)) ** 0.5 * burst_g.sign(),
                               rtol=1e-5, atol=0)


def test_only_the_held_back_coordinates_age():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = CatchUpAdamW([p], **KW)
    for grad in ([1.0, 0.0, 0.0], [1.0, 0.0, 2.0], [1.0, 0.0, 0.0]):
        p.grad = torch.tensor(grad)
        opt.step()
    assert opt.state[p]["age"].tolist() == [0.0, 3.0, 1.0]


def test_state_dict_round_trip():
    torch.manual_seed(2)
    b = torch.nn.Parameter(torch.randn(64))
    opt = CatchUpAdamW([b], **KW)
    for _ in range(3):
        b.grad = torch.randn(64) * (torch.rand(64) < 0.3)
        opt.step()
    c = torch.nn.Parameter(b.detach().clone())
    opt2 = CatchUpAdamW([c], **KW)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))  # as from a checkpoint: the ages come back
    assert torch.equal(opt2.state[c]["age"], opt.state[b]["age"]) and opt.state[b]["age"].max() > 0
    g = torch.randn(64)
    b.grad, c.grad = g.clone(), g.clone()
    opt.step()
    opt2.step()
    assert torch.equal(b, c)


@pytest.mark.parametrize("kw, text", [
    (dict(betas=(0.9, 1.0)), r"betas \(\(0.9, 1.0\)\) must be in \[0, 1\)"),
    (dict(lr=-1.0), r"lr \(-1.0\) must be >= 0"),
    (dict(eps=0.0), r"eps \(0.0\) must be > 0"),
])
def test_bad_hyperparameters_raise(kw, text):
    with pytest.raises(ValueError, match=text):
        CatchUpAdamW([torch.nn.Parameter(torch.zeros(1))], **kw)


# --- the DeepSpeed recipe's --catch_up_adam ---------------------------------------------------------------
def test_recipe_builds_the_optimizer_from_the_config_adamw_settings(tmp_path):
    args = finetune_llm.parse_args(["--deepspeed_config", os.path.join(ROOT, "configs", "demo_ds.json"),
                                    "--output_dir", str(tmp_path), "--catch_up_adam"])
    ds = finetune_llm.load_ds_config(args)
    opt = finetune_llm.client_optimizer(args, ds, torch.nn.Linear(4, 4))
    assert isinstance(opt, CatchUpAdamW) and "optimizer" not in ds and ds["zero_allow_untested_optimizer"]
    assert opt.defaults["lr"] == 0.003 and opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["weight_decay"] == 0.01


@pytest.mark.parametrize("extra, dgc, optimizer, want", [
    ([], True, None, ("catch_up", "the default for DGC under Adam")),  # the demo's config: DGC 5 %, AdamW
    ([], False, None, ("config", "no DGC")),
    ([], True, {"type": "SGD", "params": {"lr": 0.1}}, ("config", "not Adam")),
    (["--plain_adam"], True, None, ("config", "--plain_adam")),
    (["--catch_up_adam"], False, None, ("catch_up", "--catch_up_adam")),
])
def test_recipe_trains_dgc_under_adam_with_catch_up_unless_told(tmp_path, extra, dgc, optimizer, want):
    cfg = json.load(open(os.path.join(ROOT, "configs", "demo_ds.json")))
    cfg["zen"]["dgc"]["enabled"] = dgc
    if optimizer:
        cfg["optimizer"] = optimizer
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    args = finetune_llm.parse_args(["--deepspeed_config", str(path), "--output_dir", str(tmp_path / "out"), *extra])
    ds = finetune_llm.load_ds_config(args)
    kind, why = finetune_llm.optimizer_choice(args, ds)
    assert (kind, why.split(";")[0]) == want
    assert finetune_llm.optimizer_identity(args, ds) == {"catch_up": "CatchUpAdamW",
                                                         "config": (optimizer or {"type": "AdamW"})["type"]}[kind]
    opt = finetune_llm.client_optimizer(args, ds, torch.nn.Linear(4, 4))
    assert type(opt).__name__ == {"catch_up": "CatchUpAdamW", "config": "NoneType"}[kind]
    assert ("optimizer" in ds) == (kind == "config")


def test_a_checkpoint_saved_with_another_optimizer_is_refused_with_the_flag_that_resumes_it(tmp_path):
    """A resume under another optimizer than the checkpoint's (e.g. saved with --plain_adam, resumed with
    the default CatchUpAdamW) is a ConfigError naming what brings the saved one back, raised before any
    state is loaded; the same optimizer, or a checkpoint without the record, passes."""
    common.save_optimizer_name(str(tmp_path), "AdamW", rank=0)
    common.check_optimizer_name(str(tmp_path), "AdamW", finetune_llm._flag_for)  # same: no error
    with pytest.raises(common.ConfigError, match=r"saved with optimizer AdamW, but this run trains with CatchUpAdamW "
                                                 r"\(the default\).*resume with --plain_adam and the config's "
                                                 r"optimizer AdamW"):
        common.check_optimizer_name(str(tmp_path), "CatchUpAdamW", finetune_llm._flag_for, "the default")
    common.save_optimizer_name(str(tmp_path), "CatchUpAdamW", rank=0)
    with pytest.raises(common.ConfigError, match="resume with --catch_up_adam"):
        common.check_optimizer_name(str(tmp_path), "AdamW", finetune_llm._flag_for)
    (tmp_path / "older").mkdir()
    common.save_optimizer_name(str(tmp_path / "older"), "AdamW", rank=1)  # only rank 0 writes the record
    assert not os.listdir(tmp_path / "older")
    common.check_optimizer_name(str(tmp_path / "older"), "CatchUpAdamW", finetune_llm._flag_for)  # no record


@pytest.mark.parametrize("extra, optimizer, text", [
    (["--catch_up_adam"], {"type": "SGD", "params": {"lr": 0.1}}, "--catch_up_adam needs an Adam or AdamW"),
    (["--frozen_variance_after", "60"], None,
     r"--frozen_variance_after was removed \(its optimizer measured worse than CatchUpAdamW, the default under DGC: "
     r"docs/results/dgc_history.md\); remove the flag"),
    (["--catch_up_adam", "--plain_adam"], None, r"--catch_up_adam and --plain_adam each choose the optimizer"),
])
def test_recipe_rejects_what_it_cannot_build_before_training(tmp_path, extra, optimizer, text):
    cfg = json.load(open(os.path.join(ROOT, "configs", "demo_ds.json")))
    if optimizer:
        cfg["optimizer"] = optimizer
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    args = finetune_llm.parse_args(["--deepspeed_config", str(path), "--output_dir", str(tmp_path / "out"), *extra])
    with pytest.raises(common.ConfigError, match=text):
        finetune_llm.load_ds_config(args)


def test_a_group_without_catch_up_is_adamw_even_for_zero_gradients():
    """Natural sparsity's embedding rows are not held back: a zero there is a zero, and AdamW's moments
    decay and its momentum moves the row, as in dense training."""
    torch.manual_seed(3)
    a = torch.nn.Parameter(torch.randn(32))
    b = torch.nn.Parameter(a.detach().clone())
    c = torch.nn.Parameter(torch.randn(8))
    opt_a = torch.optim.AdamW([a], foreach=False, **KW)
    opt_b = CatchUpAdamW([{"params": [b], "catch_up": False}, {"params": [c]}], **KW)
    for t in range(8):
        g = torch.randn(32) * (torch.rand(32) < 0.4)  # many exact zeros
        a.grad, b.grad, c.grad = g.clone(), g.clone(), torch.zeros(8)
        opt_a.step()
        opt_b.step()
    torch.testing.assert_close(b.detach(), a.detach(), rtol=0, atol=1e-6)
    assert opt_b.param_groups[1]["catch_up"] and opt_b.state[c]["age"].tolist() == [8.0] * 8


def test_groups_catch_up_only_the_parameters_zen_sends_through_dgc(tmp_path):
    """The demo's tiny Llama: the DGC matrices catch up; the untied input embedding (natural sparsity),
    the norms and anything below min_numel stay AdamW. Without zen every group is AdamW."""
    model = common.build_model(os.path.join(ROOT, "configs", "models", "llama-tiny-untied.json"), seed=0,
                               vocab_size=1024)
    ds = json.load(open(os.path.join(ROOT, "configs", "demo_ds.json")))
    groups = catch_up_param_groups(model, ZenConfig.from_ds_config(ds))
    names = {id(p): n for n, p in model.named_parameters()}
    up = sorted(names[id(p)] for g in groups if g["catch_up"] for p in g["params"])
    rest = sorted(names[id(p)] for g in groups if not g["catch_up"] for p in g["params"])
    assert len(up) == 15 and all(n.endswith("proj.weight") or n == "lm_head.weight" for n in up), up
    assert "model.embed_tokens.weight" in rest and any("norm" in n for n in rest)
    assert len(up) + len(rest) == len(list(model.parameters()))
    ds.pop("zen")
    assert [g["catch_up"] for g in catch_up_param_groups(model, ZenConfig.from_ds_config(ds))] == [False]


def test_colossalai_train_optimizer_builds_catch_up_adamw_or_raises():
    from recipes.finetune_llm_colossalai import TrainSettings, build_optimizer

    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64))
    zen = ZenConfig.from_json_section({"dgc": {"enabled": True}})
    opt = build_optimizer(TrainSettings.from_dict({"optimizer": "catch_up_adamw", "lr": 0.01}), zen, model)
    assert isinstance(opt, CatchUpAdamW) and opt.defaults["lr"] == 0.01
    assert [(g["catch_up"], len(g["params"])) for g in opt.param_groups] == [(True, 1), (False, 2)]  # Linear.weight; embedding, bias
    assert type(build_optimizer(TrainSettings.from_dict({"optimizer": "adamw"}), zen, model)) is torch.optim.AdamW
    # "auto" (the default): CatchUpAdamW under DGC, AdamW without it.
    assert type(build_optimizer(TrainSettings.from_dict({}), zen, model)) is CatchUpAdamW
    no_dgc = ZenConfig.from_json_section({"dgc": {"enabled": False}})
    assert type(build_optimizer(TrainSettings.from_dict({}), no_dgc, model)) is torch.optim.AdamW
    with pytest.raises(ValueError, match=r"train.optimizer \('adam'\) must be one of \['auto', 'adamw', "
                                         r"'catch_up_adamw'\]"):
        TrainSettings.from_dict({"optimizer": "adam"})
    with pytest.raises(TypeError, match=r"train.optimizer \(1\) must be a string"):
        TrainSettings.from_dict({"optimizer": 1})


def test_ages_count_in_fp32_for_bf16_parameters_and_survive_a_checkpoint():
    """A bf16 count stops at 256 (256 + 1 rounds to 256), and torch casts loaded state to the parameter's
    dtype: the age is kept and restored in fp32, so a coordinate held back 300 steps catches up 300."""
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    opt = CatchUpAdamW([p], **KW)
    for _ in range(300):
        p.grad = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.bfloat16)
        opt.step()
    assert opt.state[p]["age"].dtype == torch.float32 and opt.state[p]["age"].tolist() == [0.0, 300.0, 300.0, 300.0]
    q = torch.nn.Parameter(p.detach().clone())
    opt2 = CatchUpAdamW([q], **KW)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert opt2.state[q]["age"].dtype == torch.float32 and opt2.state[q]["age"].tolist() == [0.0, 300.0, 300.0, 300.0]
    assert opt2.state[q]["exp_avg"].dtype == torch.bfloat16  # the rest as torch loads it


# --- the fused CPU op against the torch path -------------------------------------------------------------
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_fused_op_equals_the_torch_path(monkeypatch, dtype, tol):
    """``zen_ext.ops.catch_up_adamw_`` (one pass per tensor) against the torch path, its oracle, over 30
    steps of DGC-like gradients: most coordinates wait, some every step, a few for long, in a group that
    catches up and one that does not, with an empty tensor among them. Weights, moments and ages agree
    to rounding (the op keeps the denominator in float32, the torch path in the parameter's dtype; fp16
    takes eps 1e-4, since 1e-8 is 0 in fp16, and a v that underflows would divide the torch path by 0)."""
    from zen_ext import ops

    if not ops.HAVE_CPP_OP:
        pytest.skip("zen_ext._C is not built")
    gen = torch.Generator().manual_seed(5)
    shapes = [(64, 48), (0,), (1000,), (7,)]
    init = [torch.randn(s, generator=gen).to(dtype) for s in shapes]

    def make():
        ps = [torch.nn.Parameter(t.clone()) for t in init]
        kw = dict(KW, eps=1e-4) if dtype == torch.float16 else KW
        return ps, CatchUpAdamW([{"params": ps[:3]}, {"params": ps[3:], "catch_up": False}], **kw)

    fused_p, fused = make()
    torch_p, slow = make()
    grads = [torch.zeros_like(p) for p in fused_p[:3]]
    assert ops._catch_up_fits(fused_p[:3], grads) and not ops._catch_up_fits([fused_p[0].t()], [grads[0].t()])
    for step in range(30):
        for a, b in zip(fused_p, torch_p):
            keep = torch.rand(a.shape, generator=gen) < (0.05 if step % 7 else 0.6)
            keep.view(-1)[:3] = True  # a few coordinates every step (k = 1: AdamW)
            g = (torch.randn(a.shape, generator=gen) * keep).to(dtype)
            a.grad, b.grad = g.clone(), g.clone()
        fused.step()
        with monkeypatch.context() as mp:
            mp.setattr(ops, "HAVE_CPP_OP", False)  # every op takes its torch reference
            slow.step()
    for a, b in zip(fused_p, torch_p):
        torch.testing.assert_close(a.detach().float(), b.detach().float(), rtol=tol, atol=tol)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(fused.state[a][key].float(), slow.state[b][key].float(), rtol=tol, atol=tol)
        assert torch.equal(fused.state[a]["age"], slow.state[b]["age"])
    assert fused.state[fused_p[2]]["age"].max() >= 5  # long waits were exercised
    assert not fused.state[fused_p[3]]["age"].any()  # the group without catch-up never waits


def test_fused_op_rejects_what_it_cannot_run():
    from zen_ext import ops

    if not ops.HAVE_CPP_OP:
        pytest.skip("zen_ext._C is not built")
    p = torch.zeros(4, dtype=torch.float64)
    op = torch.ops.zen_ext.catch_up_adamw_
    with pytest.raises(RuntimeError, match="supported: float32, bfloat16, float16"):
        op([p], [p], [p.clone()], [p.clone()], [torch.zeros(4)], 0.1, 0.9, 0.95, 1e-8, 0.0, 1, True)
    f = torch.zeros(4)
    with pytest.raises(RuntimeError, match="the ages of parameter 0 must be a contiguous float32"):
        op([f], [f], [f.clone()], [f.clone()], [torch.zeros(4, dtype=torch.bfloat16)], 0.1, 0.9, 0.95, 1e-8, 0.0, 1,
           True)
    assert not ops._catch_up_fits([p], [p])  # float64 takes the torch reference
    q = torch.zeros(4, 3)
    assert ops._catch_up_fits([q], [q.clone()]) and not ops._catch_up_fits([q], [torch.zeros(3, 4).t()])
    # ops.catch_up_adamw_ runs what the op rejects through the reference: float64 steps like float32
    p64, p32 = torch.ones(4, dtype=torch.float64), torch.ones(4)
    for w in (p64, p32):
        ops.catch_up_adamw_([w], [torch.full_like(w, 0.5)], [torch.zeros_like(w)], [torch.zeros_like(w)],
                            [torch.zeros(4)], lr=0.1, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, step=1,
                            catch_up=True)
    torch.testing.assert_close(p64.float(), p32)
    assert (p32 < 1).all()  # one AdamW step of a positive gradient
