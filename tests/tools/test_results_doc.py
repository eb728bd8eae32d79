# SPDX-License-Identifier: Apache-2.0
"""tools/results_doc.py: docs/results.md and README's results table are what
the committed results JSON render now, so a figure cannot drift from its file."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tools import results_doc
from tools._common import REPO_ROOT, StackError


def test_docs_are_what_the_results_render():
    assert results_doc.DOC.read_text() == results_doc.render_doc(), (
        "docs/results.md is stale: run `python -m tools.results_doc` and commit it")
    readme = results_doc.README.read_text()
    assert results_doc.readme_with_table(readme) == readme, (
        "README.md's results table is stale: run `python -m tools.results_doc` and commit it")


def test_every_claim_names_a_committed_file_once():
    files = [c.file for c in results_doc.CLAIMS]
    assert len(files) == len(set(files))
    for f in files:
        assert (results_doc.RESULTS / f).is_file(), f


def test_a_figure_comes_from_its_file(tmp_path, monkeypatch):
    """Change one figure in a copy of the results: the rendering changes with
    it, and only there (the figure is read, not typed)."""
    shutil.copytree(results_doc.RESULTS, tmp_path / "results")
    claim = next(c for c in results_doc.CLAIMS if c.key == "speed")
    path = tmp_path / "results" / claim.file
    d = json.loads(path.read_text())
    before = d["batches"]["batch8"]["speedup"]["median"]
    d["batches"]["batch8"]["speedup"]["median"] = 7.654321
    path.write_text(json.dumps(d))
    was = results_doc.render_doc()
    monkeypatch.setattr(results_doc, "RESULTS", tmp_path / "results")
    now = results_doc.render_doc()
    changed = [(a, b) for a, b in zip(was.splitlines(), now.splitlines()) if a != b]
    assert len(changed) == 1, changed
    assert f"| {before:.2f} (" in changed[0][0] and "| 7.65 (" in changed[0][1]
    assert "7.65x" in results_doc.render_readme_table()


def test_the_check_fails_on_a_stale_document(tmp_path, monkeypatch):
    stale = tmp_path / "results.md"
    stale.write_text(results_doc.render_doc().replace("4.00", "4.01", 1))
    readme = tmp_path / "README.md"
    readme.write_text(results_doc.README.read_text())
    monkeypatch.setattr(results_doc, "DOC", stale)
    monkeypatch.setattr(results_doc, "README", readme)
    monkeypatch.setattr(sys, "argv", ["results_doc", "--check"])
    assert results_doc.main() == 1
    monkeypatch.setattr(sys, "argv", ["results_doc"])
    assert results_doc.main() == 0
    monkeypatch.setattr(sys, "argv", ["results_doc", "--check"])
    assert results_doc.main() == 0 and stale.read_text() == results_doc.render_doc()


def test_readme_without_its_markers_is_refused():
    with pytest.raises(StackError, match="results:begin"):
        results_doc.readme_with_table("# README\n\nno table here\n")


def test_the_command_line_check_passes_on_the_committed_tree():
    r = subprocess.run([sys.executable, "-m", "tools.results_doc", "--check"], cwd=REPO_ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
