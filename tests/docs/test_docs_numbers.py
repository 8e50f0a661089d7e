"""The numbers the docs print (tools/docs_numbers.py's regions: bytes and collectives per style,
explain(), the profiler's reports, the log, the models' bytes) are what the code prints now: each
region is made again in a process of its own and compared with the page, character for character.
On a difference, ``make docs-numbers`` rewrites the pages."""
from __future__ import annotations

import os
import re
import sys

import pytest

from doc_blocks import PAGES, ROOT

sys.path.insert(0, str(ROOT / "tools"))
import docs_numbers  # noqa: E402

REGION_TIMEOUT_S = 600


@pytest.mark.parametrize("name", sorted(docs_numbers.REGIONS))
def test_the_region_is_what_the_code_prints(name, launch_tools):
    env = launch_tools.job_env(extra={"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])})
    result = launch_tools.run_job([sys.executable, str(ROOT / "tools" / "docs_numbers.py"), "--check", "--only", name], env=env,
                     timeout=REGION_TIMEOUT_S, cwd=str(ROOT))
    assert result.returncode == 0, result.describe()


def test_every_generated_region_of_the_docs_has_a_generator():
    marked = {m for page in PAGES for m in re.findall(r"<!-- generated: ([\w-]+) -->", page.read_text())}
    assert marked == set(docs_numbers.REGIONS)
    for name in docs_numbers.REGIONS:
        docs_numbers.written(name)              # once, in the page the generator names
