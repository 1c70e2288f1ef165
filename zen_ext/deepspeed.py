"""ZEN for DeepSpeed, the public surface: ``import zen_ext.deepspeed``.

Either replace the call::

    engine, optimizer, _, scheduler = zen_ext.deepspeed.initialize(model=model, config="ds_config.json", ...)

or opt in once, so that every ``deepspeed.initialize`` (HF Trainer, Accelerate) attaches ZEN::

    zen_ext.deepspeed.enable()

ZEN is attached when the config has a ``"zen"`` section with ``"enabled": true`` (the default);
docs/deepspeed.md lists every key. Importing this module does not import DeepSpeed.
"""

from .engines.deepspeed import (
    VERIFIED_DEEPSPEED,
    ZenDeepSpeed,
    attach,
    check_deepspeed_version,
    disable,
    enable,
    initialize,
)

__all__ = ["VERIFIED_DEEPSPEED", "ZenDeepSpeed", "attach", "check_deepspeed_version", "disable", "enable",
           "initialize"]
