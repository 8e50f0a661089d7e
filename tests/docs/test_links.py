"""Every file the README and docs/ name (``examples/howto/fsdp.py``, ``docs/api.md``, links) exists."""
from __future__ import annotations

import re

import pytest

from doc_blocks import PAGES, ROOT

PATH = re.compile(r"(?<![\w/.])((?:examples|docs|benchmarks|src|tests)/[\w/.-]+\.(?:py|md|ipynb|json))")


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_named_files_exist(page):
    named = set(PATH.findall(page.read_text()))
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"{page.name} names files that do not exist: {missing}"
