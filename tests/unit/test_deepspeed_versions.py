"""The DeepSpeed version gate and the hooks that differ between the served DeepSpeed lines
(zen_ext/engines/deepspeed_compat.py), on stand-ins: no DeepSpeed engine is built here; the e2e tests
run the real hooks (launch/test_deepspeed_versions.sh runs them on each served line)."""

import dataclasses
import logging

import pytest
import torch

from zen_ext.engines import deepspeed_compat as compat
from zen_ext.engines.deepspeed import check_deepspeed_version


@pytest.fixture(autouse=True)
def _no_override(monkeypatch):
    monkeypatch.delenv(compat.ALLOW_UNVERIFIED_ENV, raising=False)


def test_tested_releases_are_served_silently(caplog):
    with caplog.at_level(logging.WARNING, logger="zen_ext.engines.deepspeed"):
        for v in ("0.18.9", "0.19.8", "0.19.8+cpu"):
            assert check_deepspeed_version(v) == v
            assert compat.version_status(v)[0] == "tested"
    assert caplog.records == []


def test_other_patches_of_a_served_line_warn(caplog):
    with caplog.at_level(logging.WARNING, logger="zen_ext.engines.deepspeed"):
        assert check_deepspeed_version("0.18.2") == "0.18.2"
    status, msg = compat.version_status("0.18.2")
    assert status == "warned"
    assert msg == ("zen_ext's DeepSpeed overrides were tested on deepspeed 0.18.9, 0.19.8, not 0.18.2: the "
                   "signatures of the hooks it overrides are checked at attach, and every optimizer step checks that "
                   "the override ran. "
                   "Tested in this line: deepspeed==0.18.9 (launch/test_deepspeed_versions.sh 0.18.2 runs the "
                   "adapter's tests on yours)")
    assert [r.getMessage() for r in caplog.records] == [msg]
    assert compat.version_status("0.19.0")[0] == "warned"
    assert compat.version_status("0.17.6")[0] == "refused"
    assert "deepspeed 0.17 lacks a double IPG buffer (ZeRO-1/2's IPGBucket.clear resets its index" in (
        compat.version_status("0.17.6")[1])
    assert ("a gradient reset after bf16 steps without ZeRO (its DeepSpeedEngine._take_model_step clears no "
            "gradient there" in compat.version_status("0.17.6")[1])


@pytest.mark.parametrize("version", ["0.16.9", "0.20.0", "1.0.0", "0.15.4"])
def test_other_lines_are_refused(version):
    with pytest.raises(RuntimeError) as info:
        check_deepspeed_version(version)
    assert str(info.value) == (
        f"zen_ext overrides private DeepSpeed methods and was tested on deepspeed 0.18.9, 0.19.8, found "
        f"{version} (other releases are untested); install one of them (launch/setup.sh installs 0.19.8), or set "
        f"ZEN_EXT_ALLOW_UNVERIFIED_DEEPSPEED=1 to try anyway (every optimizer step checks that the override ran)")


def test_a_line_known_to_lack_a_hook_names_it(monkeypatch):
    monkeypatch.setitem(compat.MISSING_HOOKS, "0.16", "DeepSpeedZeroOptimizer.average_tensor's owner segments")
    status, msg = compat.version_status("0.16.9")
    assert status == "refused"
    assert "found 0.16.9 (deepspeed 0.16 lacks DeepSpeedZeroOptimizer.average_tensor's owner segments)" in msg


def test_override_variable_turns_a_refusal_into_a_warning(monkeypatch, caplog):
    monkeypatch.setenv(compat.ALLOW_UNVERIFIED_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="zen_ext.engines.deepspeed"):
        assert check_deepspeed_version("0.20.0") == "0.20.0"
    assert caplog.records[0].getMessage().startswith("zen_ext overrides private DeepSpeed methods")


# --- hooks that differ between the lines ----------------------------------------------------------------
class _Z3Old:
    dp_process_group = "dp"
    dtype = torch.bfloat16


class _Z3New(_Z3Old):
    gradient_accumulation_dtype = torch.float32

    def _get_param_partition_group(self, param):
        return ("group of", param)

    def _gradient_averaging_world_size(self, params, n):
        return n // 2


def test_zero3_hooks_fall_back_to_the_data_parallel_group():
    old, new = _Z3Old(), _Z3New()
    assert compat.z3_partition_group(old, "p") == "dp"
    assert compat.z3_partition_group(new, "p") == ("group of", "p")
    assert compat.z3_averaging_world_size(old, ["p"], 4) == 4
    assert compat.z3_averaging_world_size(new, ["p"], 4) == 2
    assert compat.z3_result_dtype(old) is torch.bfloat16
    assert compat.z3_result_dtype(new) is torch.float32


def test_scatter_entries_of_both_forms():
    t, out = torch.zeros(3), torch.ones(3)
    assert compat.scatter_entry((1, t)) == (frozenset({1}), t, None)  # 0.17 / 0.18
    assert compat.scatter_entry((frozenset({0, 1}), t)) == (frozenset({0, 1}), t, None)
    assert compat.scatter_entry((frozenset({2}), t, out)) == (frozenset({2}), t, out)  # 0.19


def test_allreduce_no_retain_gets_output_bucket_only_when_there_is_one():
    calls = []

    def old(bucket, dtype, numel, rank, log, divide, group):  # 0.17 / 0.18: no output_bucket
        calls.append(("old", rank))

    def new(bucket, dtype, numel, rank, log, divide, group, output_bucket=None):
        calls.append(("new", rank, output_bucket))

    compat.call_allreduce_no_retain(old, [], torch.float32, 10, 1, None, False, "g", None)
    compat.call_allreduce_no_retain(new, [], torch.float32, 10, 0, None, False, "g", ["o"])
    assert calls == [("old", 1), ("new", 0, ["o"])]


def test_copy_grads_in_partition_passes_the_group_index_where_taken():
    class Old:
        def copy_grads_in_partition(self, param):
            self.got = (param, )

    class New:
        def copy_grads_in_partition(self, param, group_idx=None):
            self.got = (param, group_idx)

    o, n = Old(), New()
    compat.copy_grads_in_partition(o, "p", 3)
    compat.copy_grads_in_partition(n, "p", 3)
    assert o.got == ("p", ) and n.got == ("p", 3)


def test_async_ipg_is_off_where_clear_resets_the_buffer_index():
    @dataclasses.dataclass
    class Resets:  # DeepSpeed 0.17's IPGBucket
        index: int = 0

        def clear(self):
            self.index = 0

    @dataclasses.dataclass
    class Keeps:  # 0.18 / 0.19
        index: int = 0

        def clear(self):
            pass

    class Opt:
        def __init__(self, cls):
            self.ipg_buckets = {torch.float32: cls()}

    assert compat.async_ipg_unsupported(Opt(Resets)) == (
        "this DeepSpeed's IPGBucket.clear resets the IPG buffer index (one buffer in use)")
    assert compat.async_ipg_unsupported(Opt(Keeps)) is None


def test_managed_gradient_accumulation_defaults_to_managed():
    class Old:
        pass

    class New:
        def managed_gradient_accumulation(self):
            return False

    assert compat.managed_gradient_accumulation(Old()) is True
    assert compat.managed_gradient_accumulation(New()) is False


class _EngineBefore019:
    def _backward_epilogue(self):
        self.allreduce_gradients()
        self.optimizer.backward_epilogue()


class _Engine019:
    def _backward_epilogue(self):
        self.optimizer.backward_epilogue()
        self.allreduce_gradients()


def test_bf16_optimizer_with_late_accumulation_is_refused(monkeypatch):
    import sys
    import types

    assert compat.bf16_reduces_before_accumulating(_EngineBefore019)
    assert not compat.bf16_reduces_before_accumulating(_Engine019)
    monkeypatch.setitem(sys.modules, "deepspeed", types.SimpleNamespace(__version__="0.18.9"))
    BF16_Optimizer = type("BF16_Optimizer", (), {"immediate_grad_update": False})
    eng = _EngineBefore019()
    eng.optimizer = BF16_Optimizer()
    assert compat.late_bf16_refusal(eng) == (
        "zen with BF16_Optimizer (bf16 with data_types.grad_accum_dtype fp32) needs bf16.immediate_grad_update true "
        "on deepspeed 0.18.9: its engine all-reduces the fp32 gradient buffers before the micro-batch's gradients "
        "are added to them (DeepSpeed 0.19 reorders DeepSpeedEngine._backward_epilogue), so no rank would receive "
        "the others' gradients; set \"immediate_grad_update\": true in the \"bf16\" section, or use deepspeed 0.19.8")
    eng.optimizer.immediate_grad_update = True
    assert compat.late_bf16_refusal(eng) is None
    new = _Engine019()
    new.optimizer = BF16_Optimizer()
    assert compat.late_bf16_refusal(new) is None


def test_a_hook_with_another_signature_is_refused_naming_it():
    class Zero170:  # DeepSpeed 0.17.0's ZeRO-1/2 hooks take no communication dtype
        def gradient_reduction_w_predivide(self, tensor):
            pass

    class Zero:  # 0.17.6 .. 0.19.8
        def gradient_reduction_w_predivide(self, tensor, communication_data_type):
            pass

        def average_tensor(self, tensor, communication_data_type):
            pass

        def allreduce_and_scatter(self, bucket, communication_data_type, numel_per_bucket=5, log=None, divide=True,
                                  process_group=None):
            pass

        def allreduce_no_retain(self, bucket, communication_data_type, numel_per_bucket=5, rank=None, log=None,
                                divide=True, process_group=None):
            pass

    class Engine:
        def allreduce_bucket(self, bucket, dp_group, dp_world_size=None):
            pass

    eng = Engine()
    eng.optimizer = Zero170()
    assert compat.hook_mismatch(eng, True) == (
        "zen overrides Zero170.gradient_reduction_w_predivide(tensor, communication_data_type), but this DeepSpeed's "
        "takes (tensor): no communication_data_type; supported: deepspeed 0.18.9, 0.19.8 (and other patches "
        "of those lines, with a warning)")
    eng.optimizer = Zero()
    assert compat.hook_mismatch(eng, True) is None
    assert compat.hook_mismatch(eng, False) is None  # ZeRO-0: the engine's allreduce_bucket
    del Zero.average_tensor
    assert compat.hook_mismatch(eng, True).startswith("zen overrides Zero.average_tensor, which this DeepSpeed lacks")
