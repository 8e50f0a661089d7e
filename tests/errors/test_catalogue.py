"""docs/errors.md against the library: every entry raised as documented, every error documented.

Each entry outside "Internal errors" is triggered by a case (cases.py here, or the process job of
test_process_errors.py) and must raise the documented type with a message matching the
documented one; every entry has a case and every case an entry; and every message the library's
source raises (the longest literal part of each ``raise SomeError(f"...")``) appears in some
entry, so a new error without an entry fails here.
"""
from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest

import globaltensor as gt
from cases import CASES
from catalogue import entries
from test_process_errors import PROCESS_ENTRIES

SRC = Path(gt.__file__).resolve().parent
ENTRIES = entries()


@pytest.mark.parametrize("entry_id", list(CASES))
def test_entry_is_raised_as_documented(entry_id):
    entry = ENTRIES.get(entry_id)
    assert entry is not None, f"case {entry_id} has no entry in docs/errors.md"
    with gt.simulate(4), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(BaseException) as info:
            CASES[entry_id]()
    got = info.value
    assert type(got).__name__ == entry.type, f"{entry_id}: raised {type(got).__name__}: {got}; documented {entry.type}"
    assert entry.matches(str(got)), f"{entry_id}: the message\n  {got}\ndoes not match the documented\n  {entry.message}"


def test_every_entry_has_a_case_and_every_case_an_entry():
    tested = set(CASES) | set(PROCESS_ENTRIES)
    untested = sorted(i for i, e in ENTRIES.items() if not e.internal and i not in tested)
    assert not untested, f"entries of docs/errors.md without a test: {untested}"
    internal_tested = sorted(i for i, e in ENTRIES.items() if e.internal and i in tested)
    assert not internal_tested, f"internal entries that a test triggers (move them out of Internal errors): " \
                                f"{internal_tested}"
    undocumented = sorted(tested - set(ENTRIES))
    assert not undocumented, f"tested errors missing from docs/errors.md: {undocumented}"


def _error_messages():
    """``(file:line, longest literal part)`` of each error the source raises with a literal message."""
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name.startswith("_") or not name.endswith(("Error", "Exception")):
                continue
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                parts = [first.value]
            elif isinstance(first, ast.JoinedStr):
                parts = [v.value for v in first.values if isinstance(v, ast.Constant)]
            else:
                continue
            if parts:
                yield f"{path.relative_to(SRC)}:{node.lineno}", max(parts, key=len)


def test_every_error_in_the_source_is_documented():
    documented = [e.message for e in ENTRIES.values()]
    found = list(_error_messages())
    assert len(found) > 80, f"only {len(found)} raise sites found; is the scan broken?"
    missing = [f"{where}: {text!r}" for where, text in found
               if not any(text.strip() in part for m in documented for part in m.split("…"))]
    assert not missing, "errors raised in src/globaltensor without an entry in docs/errors.md:\n" + "\n".join(missing)
