"""Every Python block of README.md and docs/*.md runs (tests/docs/doc_blocks.py: how a page gives
its setup and marks a block not run). A page runs in a process of its own, in an empty folder
where ``examples`` leads to the repository's (the pages run from the repository's root); a page
whose setup is ``setups.processes()`` runs in 4 launched gloo processes."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from doc_blocks import PAGES, ROOT, blocks, setup_name

RUN_PAGE = Path(__file__).resolve().parent / "run_page.py"
PAGE_TIMEOUT_S = 600
PAGES_WITH_CODE = [page for page in PAGES if blocks(page)]


def _ran(output: str) -> list:
    return [line.split()[-1] for line in output.splitlines() if line.startswith("ran ")]


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=[p.name for p in PAGES_WITH_CODE])
def test_every_block_of_the_page_runs(page, tmp_path, launch, launch_tools):
    expected = [b.where for b in blocks(page) if not b.not_run]
    if setup_name(page) == "processes":
        result = launch(RUN_PAGE, 4, args=[str(page)], timeout=PAGE_TIMEOUT_S, check=False)
        output = "\n".join(result.lines(0))
    else:
        (tmp_path / "examples").symlink_to(ROOT / "examples")
        env = launch_tools.job_env(extra={"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])})
        result = launch_tools.run_job([sys.executable, str(RUN_PAGE), str(page)], env=env, timeout=PAGE_TIMEOUT_S,
                         cwd=str(tmp_path))
        output = result.stdout
    assert result.returncode == 0 and _ran(output) == expected, result.describe()


def test_the_named_setups_exist_and_every_page_has_at_most_one():
    sys.path.insert(0, str(ROOT / "docs"))
    import setups
    for page in PAGES:
        name = setup_name(page)
        assert name is None or callable(getattr(setups, name, None)), f"{page.name} links setups.{name}()"


def test_blocks_left_out_say_why_and_are_few():
    left_out = [(b.where, b.not_run) for page in PAGES for b in blocks(page) if b.not_run]
    assert all(why.strip() for _, why in left_out), left_out
    assert [where for where, _ in left_out] == ["docs/coming_from_oneflow.md:28"], left_out
