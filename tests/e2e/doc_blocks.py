"""The fenced code blocks of a markdown doc with their snippet markers (tests/e2e/test_fsdp_docs.py,
test_outer_docs.py): ``<!-- snippet: NAME -->`` on the line before a block runs it, ``<!-- snippet: NAME
(not run...: why) -->`` says where it is covered instead."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MARK = re.compile(r"^<!--\s*snippet:\s*([\w.-]+)\s*(\(not run[^)]*\))?\s*-->\s*$")


def blocks(rel_path: str) -> list[tuple[str | None, bool, str, str]]:
    """``(name, runnable, lang, text)`` of every fenced block of the doc at ``rel_path`` (from the repo root)."""
    lines = open(os.path.join(ROOT, rel_path)).read().splitlines()
    out, i = [], 0
    while i < len(lines):
        if lines[i].startswith("```") and lines[i] != "```":
            mark = MARK.match(lines[i - 1]) if i else None
            end = lines.index("```", i + 1)
            out.append((mark.group(1) if mark else None, bool(mark and not mark.group(2)), lines[i][3:],
                        "\n".join(lines[i + 1 : end])))
            i = end
        i += 1
    return out
