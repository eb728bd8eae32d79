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


def _with_breakdown(tmp_path, monkeypatch, batches):
    """The committed 61-layer summary with a step breakdown added to the
    Llama drafter's cells at ``batches``, as fulldepth.py summarize writes it."""
    shutil.copytree(results_doc.RESULTS, tmp_path / "results")
    claim = next(c for c in results_doc.CLAIMS if c.key == "fulldepth")
    path = tmp_path / "results" / claim.file
    d = json.loads(path.read_text())
    for b in batches:
        d["summary"][b]["eagle3"]["breakdown"] = {
            "phases": {"forward": {"gpu_ms": 21.125, "host_ms": 1.5, "host_before_launch_ms": 0.25, "launches": 3},
                       "draft pass 1 inputs": {"gpu_ms": 0.0625, "host_ms": 0.75, "host_before_launch_ms": 0.5,
                                               "launches": 4},
                       "draft pass 1": {"gpu_ms": 0.5, "host_ms": 0.375, "host_before_launch_ms": 0.0,
                                        "launches": 6},
                       "(outside runner ranges)": {"gpu_ms": 0.0, "host_ms": 2.0, "launches": 0}},
            "draft": {"gpu_ms": 0.5625, "host_ms": 1.125, "passes": 1},
            "top_kernels": [{"name": "marlin_moe|wna16", "cat": "kernel", "grid": [132, 1, 1],
                             "block": [256, 1, 1], "calls_per_step": 122, "ms_per_step": 17.5,
                             "phase": "forward"},
                            {"name": "flash_attn_fwd", "cat": "kernel", "grid": [8, 1, 1], "block": [128, 1, 1],
                             "calls_per_step": 3, "ms_per_step": 0.25, "phase": "draft pass 3",
                             "phases": {"draft pass 3": 0.125, "draft pass 2": 0.0625, "draft pass 1": 0.0625}}],
            "unmatched_gpu_ms": 0.0}
    path.write_text(json.dumps(d))
    monkeypatch.setattr(results_doc, "RESULTS", tmp_path / "results")
    return d


def test_a_step_breakdown_renders_as_a_table_per_engine_and_batch(tmp_path, monkeypatch):
    was = results_doc.render_doc()
    d = _with_breakdown(tmp_path, monkeypatch, ["64", "128"])
    now = results_doc.render_doc()
    assert was.count("Step breakdown") == 0 and now.count("### Step breakdown") == 2
    at64 = now.split("### Step breakdown: Llama drafter, batch 64", 1)[1].split("###", 1)[0]
    wall = d["summary"]["64"]["eagle3"]["wall_ms"]
    assert f"Wall {wall:.2f} ms per step" in at64
    assert "| forward | 21.125 | 1.500 | 0.250 | 3 |" in at64
    assert "| draft pass 1 inputs | 0.062 | 0.750 | 0.500 | 4 |" in at64
    assert "| (outside runner ranges) | 0.000 | 2.000 |  | 0 |" in at64
    assert "| drafter, all 1 passes | 0.562 | 1.125 |" in at64
    # a "|" in a kernel's name does not break the table
    assert "| marlin_moe\\|wna16 | [132, 1, 1] | [256, 1, 1] | 122 | 17.500 | forward |" in at64
    assert "| flash_attn_fwd | [8, 1, 1] | [128, 1, 1] | 3 | 0.250 | draft pass 3 (+2 more) |" in at64
    # the rest of the document is unchanged: without the breakdown sections it is what it was
    kept, skip = [], False
    for ln in now.splitlines():
        skip = ln.startswith("### Step breakdown") or (skip and not ln.startswith("## "))
        if not skip:
            kept.append(ln)
    assert kept == was.splitlines()

def test_a_breakdown_figure_comes_from_its_file(tmp_path, monkeypatch):
    _with_breakdown(tmp_path, monkeypatch, ["128"])
    first = results_doc.render_doc()
    claim = next(c for c in results_doc.CLAIMS if c.key == "fulldepth")
    path = results_doc.RESULTS / claim.file
    d = json.loads(path.read_text())
    d["summary"]["128"]["eagle3"]["breakdown"]["phases"]["forward"]["gpu_ms"] = 7.654321
    path.write_text(json.dumps(d))
    changed = [(a, b) for a, b in zip(first.splitlines(), results_doc.render_doc().splitlines()) if a != b]
    assert changed == [("| forward | 21.125 | 1.500 | 0.250 | 3 |", "| forward | 7.654 | 1.500 | 0.250 | 3 |")]


def test_a_fulldepth_summary_of_plain_and_one_drafter_renders(tmp_path, monkeypatch):
    """A run of `--engines plain,llama` (no MLA drafter) renders its rows."""
    d = _with_breakdown(tmp_path, monkeypatch, ["64"])
    for cells in d["summary"].values():
        del cells["eagle3_mla"]
    claim = next(c for c in results_doc.CLAIMS if c.key == "fulldepth")
    (results_doc.RESULTS / claim.file).write_text(json.dumps(d))
    doc = results_doc.render_doc()
    assert "MLA drafter" not in doc.split("## " + claim.title, 1)[1].split("\n## ", 1)[0]
    assert "batch 64: Llama drafter, EAGLE-3 wall ms per step" in doc and "### Step breakdown" in doc
    assert claim.readme(d).startswith("Llama drafter ")


def test_the_table_names_the_targets_mla_backend_from_the_results():
    d = {"engines": {"plain": {"facts": {"attention_backends": {"target": ["TRITON_MLA"], "drafter": []}}},
                     "eagle3": {"facts": {"attention_backends": {"target": ["TRITON_MLA"],
                                                                 "drafter": ["TRITON_ATTN"]}}}},
         "runs": [{"attention_backends": {"target": ["FLASH_ATTN_MLA", "FLASH_ATTN"]}}]}
    assert results_doc.mla_backends(d) == ["FLASH_ATTN_MLA", "TRITON_MLA"]
    assert results_doc.mla_backends({"x": 1}) == []
    fulldepth = next(c for c in results_doc.CLAIMS if c.key == "fulldepth")
    row = next(r for r in results_doc.render_readme_table().splitlines() if r.startswith(f"| {fulldepth.title}"))
    assert "| FA3 build (FLASH_ATTN_MLA) |" in row
