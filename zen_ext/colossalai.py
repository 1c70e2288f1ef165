"""Public alias: ``from zen_ext.colossalai import build_booster, ZenHybridParallelPlugin``.

Importing it imports ColossalAI (the rest of zen_ext never does); see zen_ext/engines/colossalai.py.
"""

from .engines.colossalai import ZenHybridParallelPlugin, ZenTorchDDPPlugin, build_booster, build_plugin
from .engines.colossalai_compat import apply_cpu_patches
from .engines.colossalai_config import ColossalAIConfig, check_plugin_kwargs
from .engines.ddp import ZenHookState, register_zen_hook, zen_comm_hook

__all__ = [
    "ColossalAIConfig", "ZenHookState", "ZenHybridParallelPlugin", "ZenTorchDDPPlugin", "apply_cpu_patches",
    "build_booster", "build_plugin", "check_plugin_kwargs", "register_zen_hook", "zen_comm_hook",
]
