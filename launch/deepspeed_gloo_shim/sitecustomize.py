"""Test-environment shim for DeepSpeed releases before 0.19 on torch 2.13's CPU gloo backend; put on
PYTHONPATH by launch/test_deepspeed_versions.sh for those releases only, never by zen_ext itself.

DeepSpeed 0.17/0.18 ZeRO-1/2 keep each parameter group's flat bit16 buffer as the autograd output of
the flattening (``requires_grad``), and their optimizer step all-gathers the updated partitions into
it (``runtime/utils.py: all_gather_into_tensor_dp_groups``). torch 2.13's gloo ``all_gather_into_tensor``
chunks the output with ``split`` and copies into the chunks, which autograd refuses on a tensor that
requires grad: "Output 0 of Split is a view and is being modified inplace". Plain DeepSpeed fails at
its first optimizer step, with or without zen_ext (NCCL's kernels are invisible to autograd and do not
hit it). DeepSpeed 0.19 detaches the flat buffer where it creates it; this shim detaches the same
tensors where they are all-gathered (``detach`` shares their storage, so the gather lands in the same
memory): DeepSpeed's own fix, applied one call later, so that the adapter's tests reach its hooks.
"""

import importlib.abc
import importlib.machinery
import sys

_TARGET = "deepspeed.runtime.utils"


def _patch(module) -> None:
    orig = module.all_gather_into_tensor_dp_groups

    def all_gather_into_tensor_dp_groups(groups_flat, partitioned_param_groups, dp_process_group):
        return orig([g.detach() for g in groups_flat], [[p.detach() for p in ps] for ps in partitioned_param_groups],
                    dp_process_group)

    module.all_gather_into_tensor_dp_groups = all_gather_into_tensor_dp_groups


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds ``deepspeed.runtime.utils`` the ordinary way and patches it once it has run."""

    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def run_then_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = run_then_patch
        return spec


sys.meta_path.insert(0, _PatchAfterImport())
