"""The one message for unknown configuration keys, with the closest valid key ("did you mean"), and the
warning for a misspelled ``"zen"`` section name.

Shared by every section that reads a plain dict (``zen``, ``zen.dgc``, ``zen.natural``, the ColossalAI
JSON), so that a typo reads the same wherever it is made.
"""

from __future__ import annotations

import difflib
import json
import logging
from collections.abc import Iterable

SECTION = "zen"
"""The top-level key of the section in a DeepSpeed / ColossalAI JSON config."""

log = logging.getLogger("zen_ext.config")


def unknown_keys_message(path: str, unknown: Iterable[str], valid: Iterable[str], context: str = "") -> str:
    """``<path> got unknown key(s) [...]; did you mean 'x' for 'y'? valid keys are [...]``.

    Args:
        path: the section, e.g. ``"zen.dgc"``.
        unknown: the keys given that the section does not have.
        valid: the section's keys.
        context: inserted after the unknown keys (e.g. ``" for plugin 'torch_ddp'"``).
    """
    unknown, valid = sorted(unknown), sorted(valid)
    hints = [f"did you mean {close[0]!r} for {k!r}?" for k in unknown
             for close in [difflib.get_close_matches(k, valid, n=1)] if close]
    return (f"{path} got unknown key(s) {unknown}{context}; " + (" ".join(hints) + " " if hints else "")
            + f"valid keys are {valid}")


def near_miss_sections(config: dict) -> list[str]:
    """Top-level keys of ``config`` that look like a misspelled ``"zen"`` (``"zne"``, ``"Zen"``,
    ``"zen_ext"``): a key starting with "zen" or within difflib ratio 0.6 of it, case and spaces
    ignored. DeepSpeed's own keys are all further away (the nearest, ``"zero"``/``"mean"``, 0.57)."""
    out = []
    for key in config:
        if not isinstance(key, str) or key == SECTION:
            continue
        k = key.strip().lower()
        if k.startswith(SECTION) or difflib.SequenceMatcher(None, k, SECTION).ratio() >= 0.6:
            out.append(key)
    return out


def warn_near_miss_sections(config: dict) -> list[str]:
    """Warn (``logging`` WARNING, shown without any logging set-up) about near-miss section names
    when the config has no ``"zen"`` key: DeepSpeed ignores unknown top-level keys, so a typo would
    otherwise train with the dense all-reduce and say nothing. Returns the keys warned about."""
    keys = near_miss_sections(config)
    if keys and SECTION not in config:
        log.warning("zen: the config has no \"zen\" section but has %s; did you mean \"zen\"? Without it ZEN is "
                    "NOT attached and gradients use the engine's dense all-reduce",
                    ", ".join(json.dumps(k) for k in keys))
    return keys
