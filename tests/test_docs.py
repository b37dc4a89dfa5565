"""Every code block of the documentation site (docs/*.md) runs, or says why it does not.

The pages run in reading order (DOCS), one after the other in one scratch folder, as a reader who follows them
would run them (the serving guide predicts with the model the getting-started page trained). The rules are
tests/test_readme.py's: bash and python blocks run in the activated venv and must exit 0 without a warning or a
traceback; a block that must not run (a GPU command, output shown as text, a drawing) is marked
`<!-- not run: REASON -->` on the line before its fence; blocks that install an optional peer (PyTorch) run
where that peer is installed. The site itself is built with warnings as errors by .ci/run.
"""

import pathlib

import pytest

from tests.doc_util import fenced_blocks
from tests.test_readme import doc_steps, run_peer_blocks, run_steps, scratch

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: the pages in reading order (a page may use what an earlier one made)
DOCS = [
    "getting-started.md",
    "guides/hugectr.md",
    "guides/serving.md",
    "guides/data.md",
    "guides/multi-rank.md",
    "guides/large-tables.md",
    "guides/pytorch.md",
    "guides/gpu.md",
    "concepts/architecture.md",
    "concepts/engine.md",
    "concepts/devices.md",
    "concepts/trust.md",
    "concepts/guarantees.md",
    "tutorials.md",
    "cli.md",
    "differences.md",
    "coverage.md",
    "results.md",
    "benchmarks.md",
]


def pages():
    return sorted(
        p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts
    )


def test_every_page_with_code_is_in_reading_order():
    for page in pages():
        text = (ROOT / "docs" / page).read_text()
        code = [b for b in fenced_blocks(text) if not b.directive]
        assert not code or page in DOCS, f"docs/{page} has code blocks: add it to DOCS in tests/test_docs.py"


@pytest.mark.parametrize("page", DOCS)
def test_every_block_runs_or_says_why_not(page):
    doc_steps((ROOT / "docs" / page).read_text(), f"docs/{page}")  # raises on an unmarked block of another kind


@pytest.mark.slow
def test_every_docs_command_runs(tmp_path):
    scratch(tmp_path)
    for page in DOCS:
        run_steps(doc_steps((ROOT / "docs" / page).read_text(), f"docs/{page}"), tmp_path, f"docs/{page}")


@pytest.mark.slow
def test_docs_blocks_with_a_peer(tmp_path):
    n = 0
    for i, page in enumerate(DOCS):
        folder = tmp_path / f"page{i}"
        folder.mkdir()
        n += run_peer_blocks(doc_steps((ROOT / "docs" / page).read_text(), f"docs/{page}"), folder, f"docs/{page}")
    assert n, "the docs show numbactr's embeddings from PyTorch (guides/pytorch.md)"
