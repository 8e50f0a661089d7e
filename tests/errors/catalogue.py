"""docs/errors.md read as data: ``{entry id: Entry}``, and each entry's message as a pattern."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "errors.md"


@dataclass
class Entry:
    id: str
    type: str
    message: str          # the example message; "…" stands for text that varies
    internal: bool

    def matches(self, message: str) -> bool:
        pattern = ".*".join(re.escape(part) for part in self.message.split("…"))
        return re.fullmatch(pattern, message, re.DOTALL) is not None


def entries() -> dict:
    out, current, internal = {}, None, False
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            internal = line.strip() == "## Internal errors"
        elif line.startswith("### "):
            current = Entry(line[4:].strip(), "", "", internal)
            assert current.id not in out, f"docs/errors.md: entry {current.id} appears twice"
            out[current.id] = current
        elif current is not None and line.startswith("- Type: `"):
            current.type = line[len("- Type: `"):].rstrip("`")
        elif current is not None and line.startswith("    ") and not current.message:
            current.message = line[4:]
    for e in out.values():
        assert e.type and e.message, f"docs/errors.md: entry {e.id} lacks its type or its message"
    return out
