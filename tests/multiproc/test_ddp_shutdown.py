"""The DDP hook's end of training: ``optimizer=`` decides DGC's momentum
correction, ``close()`` flushes the statistics, drops the group references, is idempotent, and the
hook refuses buckets afterwards; the plain-DDP script of the README exits 0 through torchrun."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.multiproc.launch import free_port, run_workers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _worker(rank, world, jsonl):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zen_ext.engines.ddp import register_zen_hook

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 8), torch.nn.Flatten(), torch.nn.Linear(32, 64))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)  # momentum 0: DGC's DGCSGD set-up
    state = register_zen_hook(ddp, {"dgc": {"enabled": True, "min_numel": 16}, "stats": {"jsonl_path": jsonl}},
                              optimizer=opt)

    def step():
        x = torch.randint(0, 64, (2, 4), generator=torch.Generator().manual_seed(rank))
        torch.nn.functional.cross_entropy(ddp(x), x[:, 0]).backward()
        opt.step()
        opt.zero_grad()

    step()
    step()
    out = {"momentum_correction": state.cfg.dgc.momentum_correction,
           "has_momentum_state": "momentum" in str(state.sync.state_dict())}
    state.close()
    state.close()  # idempotent
    out["released"] = state.sync is None and state.reducer is None and state.closed
    if rank == 0:
        with open(jsonl) as f:
            out["records"] = [json.loads(line)["step"] for line in f]
    try:
        step()
        out["after_close"] = "ran"
    except RuntimeError as exc:
        out["after_close"] = str(exc)
    dist.barrier()
    return out


def test_optimizer_decides_momentum_and_close_releases(tmp_path):
    res = run_workers(_worker, 2, str(tmp_path / "zen_stats.jsonl"))
    for r in res:
        assert r["momentum_correction"] is True and r["has_momentum_state"]
        assert r["released"]
        assert "the ZEN hook state was closed" in r["after_close"]
    assert res[0]["records"] == [1, 2]


_SCRIPT = '''
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from zen_ext.engines.ddp import register_zen_hook

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(512, 32), torch.nn.Flatten(), torch.nn.Linear(32 * 8, 512))
ddp = DDP(model, bucket_cap_mb=128)
optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
state = register_zen_hook(ddp, {"dgc": {"enabled": True, "min_numel": 256}}, optimizer=optimizer)
for step in range(3):
    x = torch.randint(0, 512, (4, 8))
    torch.nn.functional.cross_entropy(ddp(x), x[:, 0]).backward()
    optimizer.step()
    optimizer.zero_grad()
state.summary()
state.close()
dist.destroy_process_group()
'''


def run_script(tmp_dir: str, runs: int) -> list[tuple[int, str]]:
    """Run the plain-DDP script ``runs`` times with torchrun; returns (exit code, whole output) per run.

    The whole output, not a tail: torchrun's failure report after an abort is longer than 2 KB and
    would push the child's own "terminate called" line out of a tail."""
    import pathlib

    path = pathlib.Path(tmp_dir) / "ddp_script.py"
    path.write_text(_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    out = []
    for _ in range(runs):
        proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc_per_node", "2",
                               "--master_port", str(free_port()), str(path)], cwd=tmp_dir, env=env,
                              capture_output=True, text=True, timeout=300)
        out.append((proc.returncode, proc.stdout + proc.stderr))
    return out


@pytest.mark.slow
def test_plain_ddp_script_runs_through_torchrun(tmp_path):
    """One run of the README-style script: summary printed, exit 0. (The exit abort that torch's DDP
    on gloo shows in ~1 run in 30–60, with or without ZEN, is measured by the stress mode below, not
    asserted here: ``python -m tests.multiproc.test_ddp_shutdown --runs 40``.)"""
    ((code, output),) = run_script(str(tmp_path), 1)
    # An abort's SIGTERM to the other rank can drop its unflushed stdout: the summary is checked on exit 0.
    assert "ZEN gradient synchronization summary (2 ranks, 3 optimizer steps)" in output or code != 0, output[-3000:]
    if code != 0:
        assert "terminate called without an active exception" in output, output[-3000:]
        pytest.xfail("torch DDP + gloo aborted at exit (known, torch's; docs/colossalai.md: Ending a run)")


if __name__ == "__main__":  # the shutdown stress (many short runs)
    import argparse
    import tempfile

    p = argparse.ArgumentParser(description="run the plain-DDP README script N times; count exit aborts")
    p.add_argument("--runs", type=int, default=40)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        res = run_script(d, args.runs)
    bad = [(i, c) for i, (c, _) in enumerate(res) if c != 0]
    print(f"{len(bad)} of {args.runs} runs exited non-zero: {bad}")
    for i, _ in bad:
        print(f"--- run {i} ---\n{res[i][1][-4000:]}")
