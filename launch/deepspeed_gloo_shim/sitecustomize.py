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

The same releases' blocking ZeRO-3 gather of several parameters (``Init._allgather_params_coalesced``,
behind ``GatheredParameters`` and ``param.all_gather()``) launches one asynchronous gather per parameter
and waits on the last handle only ("Wait ensures the operation is enqueued"), then points each
parameter at its gather buffer. gloo runs a group's operations on several worker threads, so an earlier
gather can still be running: the parameter then reads its ``torch.empty`` buffer (stale values or
garbage), in plain DeepSpeed and with zen_ext alike. DeepSpeed 0.19
waits on every handle ("gloo handles are independent"); this shim waits on each gather as it is
launched inside that method, which has the same effect.
"""

import importlib.abc
import importlib.machinery
import sys


def _patch_utils(module) -> None:
    orig = module.all_gather_into_tensor_dp_groups

    def all_gather_into_tensor_dp_groups(groups_flat, partitioned_param_groups, dp_process_group):
        return orig([g.detach() for g in groups_flat], [[p.detach() for p in ps] for ps in partitioned_param_groups],
                    dp_process_group)

    module.all_gather_into_tensor_dp_groups = all_gather_into_tensor_dp_groups


def _patch_partition_parameters(module) -> None:
    init_cls, dist = module.Init, module.dist
    orig = init_cls._allgather_params_coalesced

    def waited(collective):

        def call(*args, **kwargs):
            handle = collective(*args, **kwargs)
            if handle is not None:
                handle.wait()  # waiting again later on a finished handle returns at once
            return handle

        return call

    def _allgather_params_coalesced(self, *args, **kwargs):
        saved = dist.all_gather_into_tensor, dist.all_gather
        dist.all_gather_into_tensor, dist.all_gather = waited(saved[0]), waited(saved[1])
        try:
            return orig(self, *args, **kwargs)
        finally:
            dist.all_gather_into_tensor, dist.all_gather = saved

    init_cls._allgather_params_coalesced = _allgather_params_coalesced


_TARGETS = {"deepspeed.runtime.utils": _patch_utils,
            "deepspeed.runtime.zero.partition_parameters": _patch_partition_parameters}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds the modules in ``_TARGETS`` the ordinary way and patches each once it has run."""

    def find_spec(self, name, path, target=None):
        if name not in _TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def run_then_patch(module):
            exec_module(module)
            _TARGETS[name](module)

        spec.loader.exec_module = run_then_patch
        return spec


sys.meta_path.insert(0, _PatchAfterImport())
