"""CPU compatibility patches for ColossalAI 0.5.0 (upstream hpcaitech/ColossalAI#5211).

ColossalAI picks its ``CpuAccelerator`` when there is no CUDA or NPU device, but many of its methods
raise "this method is not supported for cpu accelerator" (and ``get_rng_state`` passes a device to
``torch.get_rng_state``, a TypeError) although the CPU serves them. ShardFormer's ``Randomizer`` calls
``get_rng_state`` and ``manual_seed`` while it builds ``VocabParallelEmbedding1D`` (so tensor
parallelism fails on CPU without the patch; the upstream fix, PR #5265, is unmerged), and loading an
optimizer checkpoint calls ``synchronize`` (checkpoint_io/utils.py ``load_states_into_optimizer``).
"""

from __future__ import annotations

import logging

import torch
from colossalai.accelerator import get_accelerator

log = logging.getLogger(__name__)

__all__ = ["apply_cpu_patches"]


def _get_rng_state(self, device=None):
    return torch.get_rng_state()  # upstream passes ``device`` to torch.get_rng_state, which takes none


def _get_rng_state_all(self):
    return [torch.get_rng_state()]


def _set_rng_state_all(self, new_states):
    torch.set_rng_state(new_states[0])


def _manual_seed(self, seed):
    torch.manual_seed(seed)


def _seed(self):
    torch.seed()


def _initial_seed(self):
    return torch.initial_seed()


def _no_op(self, *args, **kwargs):
    return None  # CPU kernels are synchronous and there is no device cache to empty


# CpuAccelerator method → its CPU implementation (see the module docstring for who calls which).
_CPU_PATCHES = {
    "get_rng_state": _get_rng_state,
    "get_rng_state_all": _get_rng_state_all,
    "set_rng_state_all": _set_rng_state_all,
    "manual_seed": _manual_seed,
    "manual_seed_all": _manual_seed,
    "seed": _seed,
    "seed_all": _seed,
    "initial_seed": _initial_seed,
    "synchronize": _no_op,
    "empty_cache": _no_op,
}
_PATCH_MARK = "_zen_ext_cpu_patched"


def apply_cpu_patches() -> bool:
    """Make ColossalAI 0.5.0's CPU accelerator serve its RNG methods with the CPU generator, and
    ``synchronize`` / ``empty_cache`` as no-ops.

    Applied only when the selected accelerator is the CPU (no CUDA or NPU device); idempotent.

    Returns:
        True when the patches are in place, False when the accelerator is not the CPU.
    """
    accel = get_accelerator()
    if accel.name != "cpu":
        return False
    cls = type(accel)
    if not getattr(cls, _PATCH_MARK, False):
        for name, fn in _CPU_PATCHES.items():
            setattr(cls, name, fn)
        setattr(cls, _PATCH_MARK, True)
        log.info("zen: patched ColossalAI CpuAccelerator methods (%s)", ", ".join(_CPU_PATCHES))
    return True
