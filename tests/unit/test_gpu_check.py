"""The parts of ``launch/gpu_check.sh`` that need no GPU: arguments, the no-GPU exit, the CPU half."""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "gpu"))

import gpu_check  # noqa: E402


def test_arguments_and_their_errors(capsys):
    a = gpu_check.parse_args([])
    assert a.parts == list(gpu_check.PARTS) and a.numel == 214_000_000 and a.density == 0.052
    assert a.sim_ranks == [8, 16] and a.out.endswith(os.path.join("benchmarks", "gpu", "results", "gpu_check.md"))
    assert gpu_check.parse_args(["--multi"]).out.endswith("gpu_check_multi.md")
    # A CPU smoke run writes under runs/, never over the committed GPU report.
    assert gpu_check.parse_args(["--device", "cpu"]).out.endswith(os.path.join("runs", "gpu_check_cpu.md"))
    for bad, msg in ((["--parts", "hash,nope"], "--parts (nope) must be a subset"),
                     (["--density", "0"], "--density (0.0) must be in (0, 1]"), (["--numel", "1"], "--numel (1)")):
        with pytest.raises(SystemExit):
            gpu_check.parse_args(bad)
        assert msg in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
@pytest.mark.parametrize("args", [[], ["--multi"], ["--parts", "hash"]])
def test_without_a_gpu_it_exits_nonzero_at_once_with_a_clear_message(args):
    env = dict(os.environ, ZEN_PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    p = subprocess.run(["bash", os.path.join(ROOT, "launch", "gpu_check.sh"), *args], env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert "no CUDA GPU" in p.stderr or "needs at least 2 GPUs" in p.stderr, p.stderr


def test_cpu_half_of_the_check_passes(tmp_path):
    out = tmp_path / "gpu_check.md"
    rc = gpu_check.main(["--device", "cpu", "--sim-ranks", "2,3", "--numel", "100003", "--out", str(out)])
    text = out.read_text()
    assert rc == 0, text
    assert "**PASS**" in text and "| hash | counts, entries and positions per partition equal" in text
    for name in ("zen", "agsparse", "sparcml", "omnireduce", "sparse_ps", "dense"):
        assert f"| schemes | {name} n=3 bfloat16 | ok |" in text
        assert f"| gloo | {name}: 2 processes, cpu gradients over gloo equal all_reduce | ok |" in text


def test_grouping_comparison_can_fail():
    counts = torch.tensor([2, 1])
    ok, _ = gpu_check.compare_grouping((counts, torch.tensor([1, 0, 2]), torch.tensor([5, 6, 7])),
                                       (counts, torch.tensor([0, 1, 2]), torch.tensor([6, 5, 7])), 3)
    assert ok  # same pairs per partition, another order inside it
    ok, why = gpu_check.compare_grouping((counts, torch.tensor([1, 0, 2]), torch.tensor([5, 6, 7])),
                                         (counts, torch.tensor([0, 1, 2]), torch.tensor([5, 6, 7])), 3)
    assert not ok and "positions" in why
    ok, why = gpu_check.compare_grouping((torch.tensor([1, 2]), torch.tensor([0, 1, 2]), torch.tensor([5, 6, 7])),
                                         (counts, torch.tensor([0, 1, 2]), torch.tensor([5, 6, 7])), 3)
    assert not ok and "counts differ" in why


def test_gpu_bench_cpu_smoke(tmp_path):
    """benchmarks/gpu/bench_gpu.py (docs/kernels.md's GPU cost tables) runs end to end at small sizes on the CPU."""
    import bench_gpu

    out = tmp_path / "gpu_bench.md"
    assert bench_gpu.main(["--device", "cpu", "--small", "--reps", "1", "--out", str(out)]) == 0
    text = out.read_text()
    for heading in ("## 1. DGC per bucket", "## 2. ZEN vs AGsparse", "## 2b. ZEN on embedding rows", "## 3. Hashing",
                    "## 4. Optimizer step"):
        assert heading in text
    assert text.count("| AdamW foreach | ") == 2 and text.count("| CatchUpAdamW (") >= 2
    # Each bucket and dtype with the search op and with its torch loop; rows: the three schemes.
    assert text.count("| large |") == 4 and text.count("| bench |") == 4 and "| 16 | 5% |" in text
    assert text.count("| op |") == 4 and text.count("| torch loop |") == 4
    assert "| zen (bitmap pull) |" in text and "| zen_coo |" in text and "| agsparse |" in text
