"""``python -m zen_ext <command>``: the command-line entry points.

Commands:
  demo   the offline fine-tuning demo (DeepSpeed launcher, tiny Llama, DGC + natural sparsity)
  sync   ZEN vs dense all-reduce on a real embedding gradient, on local gloo processes
  sim    simulate schemes at up to 128+ ranks in one process (SimWorld), with modeled times
"""

from __future__ import annotations

import importlib
import sys

_COMMANDS = {
    "demo": "zen_ext.demo",
    "sync": "zen_ext.sync_demo",
    "sim": "zen_ext.analysis.sim_cli",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in _COMMANDS:
        print(f"unknown command {cmd!r}; valid commands are {sorted(_COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(_COMMANDS[cmd])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
