"""The one message for unknown configuration keys, with the closest valid key ("did you mean").

Shared by every section that reads a plain dict (``zen``, ``zen.dgc``, ``zen.natural``, the ColossalAI
JSON), so that a typo reads the same wherever it is made.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


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
