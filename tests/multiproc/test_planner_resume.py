"""The ``auto`` planner's state is checkpointed; a resumed run equals the uninterrupted one.

Two gloo ranks. The gradients are very sparse for the first syncs (the planner profiles them and picks
agsparse) and dense afterwards: an uninterrupted run keeps agsparse (no re-profiling configured), while
a resumed run that lost the planner's state re-profiles on the dense gradients and switches to dense
(with 3+ ranks in bf16 also with different bits: agsparse sums in fp32, the dense all-reduce in bf16).
"""

from __future__ import annotations

import os
import tempfile

import torch

from tests.multiproc.launch import run_workers

NUMEL, STEPS, CUT = 1 << 20, 6, 3
OPTS = dict(candidates=["dense", "agsparse"], profile_steps=2, reprofile_every=0, bandwidth_gbps=0.1,
            latency_us=50.0)


def _grad(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    vals = torch.randn(NUMEL, generator=g).to(torch.bfloat16)
    if step < CUT:  # 0.01 % of the elements: agsparse wins by ~10x on a 0.1 Gbit/s link
        mask = torch.zeros(NUMEL, dtype=torch.bool)
        mask[torch.randint(0, NUMEL, (NUMEL // 10000,), generator=g)] = True
        vals = vals * mask
    return vals


def _run(rank, world, resume_with_state):
    from zen_ext.planner.auto import AutoScheme
    from zen_ext.comm.torch_dist import TorchCommunicator

    comm = TorchCommunicator()

    def sync_steps(auto, steps):
        outs, choices = [], []
        for step in steps:
            t = {}
            outs.append(auto.sync(comm, _grad(step, rank), key="w", timings=t))
            choices.append(t["scheme"])
        return outs, choices

    ref_outs, ref_choices = sync_steps(AutoScheme(**OPTS), range(STEPS))
    first = AutoScheme(**OPTS)
    outs, choices = sync_steps(first, range(CUT))
    sd = first.state_dict()
    resumed = AutoScheme(**OPTS)
    if resume_with_state:
        # Through a real checkpoint file, in a directory of this process's own (two suites at once on
        # one machine must not read each other's state).
        with tempfile.TemporaryDirectory() as d:
            torch.save(sd, os.path.join(d, f"zen_auto_state_{rank}.pt"))
            resumed.load_state_dict(torch.load(os.path.join(d, f"zen_auto_state_{rank}.pt"), weights_only=False))
    more, more_choices = sync_steps(resumed, range(CUT, STEPS))
    return ref_outs, ref_choices, outs + more, choices + more_choices, resumed.explain()


def test_resumed_auto_equals_the_uninterrupted_run():
    for rank, (ref_outs, ref_choices, outs, choices, explain) in enumerate(run_workers(_run, 2, True)):
        assert ref_choices == ["agsparse"] * STEPS
        assert choices == ref_choices, rank
        for step, (a, b) in enumerate(zip(ref_outs, outs)):
            assert torch.equal(a, b), (rank, step)
        assert "auto[w] -> agsparse" in explain and "agsparse* " in explain


def test_without_the_state_a_resumed_run_diverges():
    """The failure the checkpoint prevents (what a resumed run without it did): re-profiling picks dense."""
    for ref_outs, ref_choices, outs, choices, _ in run_workers(_run, 2, False):
        assert choices[CUT:] == ["dense"] * (STEPS - CUT) != ref_choices[CUT:]


def test_auto_state_rejects_other_options():
    import pytest

    from zen_ext.planner.auto import AutoScheme

    sd = AutoScheme(**OPTS).state_dict()
    with pytest.raises(ValueError, match=r"auto state_dict options .* must equal this planner's"):
        AutoScheme(**{**OPTS, "candidates": ["dense", "zen"]}).load_state_dict(sd)
    with pytest.raises(ValueError, match=r"auto state_dict version \(None\) must be 1"):
        AutoScheme(**OPTS).load_state_dict({})
