"""The Python blocks of README.md and docs/*.md, as the doc tests run them.

A page's blocks start from its setup. A page that links a named setup of docs/setups.py -- the
link text is the call, [`setups.NAME()`](setups.py) -- runs each block in a fresh namespace from
that call: every block stands on the setup alone. A page without one runs its blocks in order in
one namespace, its first block being its visible setup. A block right after an HTML comment
``<!-- not run: why -->`` is left out, with the reason (another library, another launcher).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_NOT_RUN = re.compile(r"<!-- not run: (.+?) -->\s*\Z", re.S)
_SETUP = re.compile(r"\[`setups\.(\w+)\(\)`\]\((?:docs/)?setups\.py\)")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int               # the line of the block's first code line in the page
    code: str
    not_run: Optional[str]  # why the block is left out, or None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> List[Block]:
    text = page.read_text()
    found = []
    for m in _FENCE.finditer(text):
        before = text[:m.start()]
        reason = _NOT_RUN.search(before)
        found.append(Block(page, before.count("\n") + 2, m.group(1), reason.group(1) if reason else None))
    return found


def setup_name(page: Path) -> Optional[str]:
    """The named setup the page links, or None (its first block is its setup)."""
    names = set(_SETUP.findall(page.read_text()))
    if len(names) > 1:
        raise ValueError(f"{page.name} links several setups: {sorted(names)}; a page has one")
    return names.pop() if names else None
