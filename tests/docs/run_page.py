"""Run one page's Python blocks (tests/docs/doc_blocks.py says how), in this process.

    python tests/docs/run_page.py docs/howto.md

Each block is compiled under the page's name with its own line numbers, so a traceback points
at the page's line. Prints ``ran PAGE:LINE`` per block, or ``FAILED PAGE:LINE`` and the traceback;
exits with 1 if a block failed. A page of independent blocks (a named setup) runs them all; a
page whose blocks run in one namespace stops at the first failure.
"""
from __future__ import annotations

import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doc_blocks import ROOT, blocks, setup_name  # noqa: E402

sys.path.insert(0, str(ROOT / "docs"))


def run(page: Path) -> int:
    name = setup_name(page)
    shared: dict = {}
    failed = 0
    for block in blocks(page):
        if block.not_run:
            print(f"not run {block.where}: {block.not_run}", flush=True)
            continue
        if name:
            import setups
            namespace = getattr(setups, name)()
        else:
            namespace = shared
        namespace.setdefault("__name__", "__doc_block__")
        code = compile("\n" * (block.line - 1) + block.code, str(block.page), "exec")
        try:
            exec(code, namespace)
        except BaseException:
            print(f"FAILED {block.where}\n{traceback.format_exc()}", flush=True)
            failed += 1
            if not name:
                break
            continue
        print(f"ran {block.where}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run(Path(sys.argv[1]).resolve()))
