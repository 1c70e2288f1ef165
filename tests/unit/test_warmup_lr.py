"""recipes/common.py's warm-up: the FSDP recipe's learning rate at every step equals DeepSpeed's ``WarmupLR``
as the DeepSpeed engine steps it (after each optimizer step), so the two recipes train on the same rates."""

import pytest
import torch

from recipes import common


def _deepspeed_rates(steps: int, warmup_steps: int, warmup_type: str) -> list[float]:
    """The rate each optimizer step 1..steps runs at under DeepSpeed's WarmupLR (peak 1.0, from 0)."""
    from deepspeed.runtime.lr_schedules import WarmupLR

    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([param], lr=1.0)
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=warmup_steps,
                     warmup_type=warmup_type)
    rates = []
    for _ in range(steps):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()  # DeepSpeedEngine._take_model_step: the scheduler after the optimizer
    return rates


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
@pytest.mark.parametrize("warmup_steps", [1, 2, 10, 25])
def test_the_warm_up_equals_deepspeeds_warmup_lr_step_for_step(warmup_steps, warmup_type):
    ours = [common.warmup_lr_factor(s, warmup_steps, warmup_type) for s in range(1, 40)]
    assert ours == _deepspeed_rates(39, warmup_steps, warmup_type)  # to the last bit


def test_the_demo_warm_up_values():
    # configs/demo_ds.json: 10 log steps. Steps 1 and 2 at 0, log(2)/log(10) at step 3, the peak (to
    # rounding) at step 11, exactly from step 12.
    f = [common.warmup_lr_factor(s, 10) for s in range(1, 14)]
    assert f[:2] == [0.0, 0.0] and f[2] == pytest.approx(0.30103, abs=1e-5)
    assert f[10] == pytest.approx(1.0) and f[11:] == [1.0, 1.0] and all(a < b for a, b in zip(f[1:10], f[2:11]))
    assert common.warmup_lr_factor(1, 0) == 1.0  # no warm-up: the peak from the first step


def test_an_unknown_warm_up_curve_is_refused():
    with pytest.raises(common.ConfigError, match=r"warmup_type \('cosine'\) must be one of \['log', 'linear'\]"):
        common.warmup_lr_factor(3, 10, "cosine")
