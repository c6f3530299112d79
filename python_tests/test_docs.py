"""The documentation: generated tables match the result files they name, and every relative link
of the README and docs/ points at a file (and heading) that exists."""

import importlib.util
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", "bench/README.md"] + sorted(
    os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def load_e2e():
    spec = importlib.util.spec_from_file_location("bench_e2e", os.path.join(ROOT, "bench", "e2e.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def anchors(path: str) -> set:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces to '-'."""
    with open(path) as f:
        headings = [line.lstrip("#").strip() for line in f if line.startswith("#")]
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("doc", load_e2e().DOCS)
def test_generated_tables_match_results(doc):
    e2e = load_e2e()
    with open(os.path.join(ROOT, doc)) as f:
        text = f.read()
    assert e2e.GENERATED.search(text), f"{doc}: no generated section"
    assert e2e.render_doc(text) == text, f"{doc} is out of date: run python bench/e2e.py --render-docs"


def test_render_doc_fills_a_section(tmp_path):
    e2e = load_e2e()
    empty = "before\n<!-- e2e-table bench/results/intel-xeon-2core/e2e.json -->\nstale\n<!-- /e2e-table -->\nafter\n"
    rendered = e2e.render_doc(empty)
    assert "stale" not in rendered and rendered.startswith("before\n") and rendered.endswith("after\n")
    assert "| code | 0 | 1 | ours-plain |" in rendered


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_resolve(page):
    with open(os.path.join(ROOT, page)) as f:
        text = re.sub(r"```.*?```", "", f.read(), flags=re.S)  # code blocks hold no links
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # absolute URL
        file, _, anchor = target.partition("#")
        path = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), file)) if file else os.path.join(ROOT, page)
        if not os.path.exists(path):
            broken.append(target)
        elif anchor and path.endswith(".md") and anchor not in anchors(path):
            broken.append(target)
    assert not broken, f"{page}: broken links {broken}"
