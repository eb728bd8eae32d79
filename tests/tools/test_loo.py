# SPDX-License-Identifier: Apache-2.0
"""tools.loo on a tiny synthetic series, site and test suite."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from stack_tooling import run_tool

# P1 adds `a`; P2 changes the line P1 added (so it goes when P1 goes); P3
# adds a module; P4 touches a file outside the site's packages, which no test
# can see.
PATCHES = {
    "Add-a.patch": """--- a/pkg/mod.py
+++ b/pkg/mod.py
@@ -1 +1,2 @@
 x = 1
+a = 1
""",
    "Bump-a.patch": """--- a/pkg/mod.py
+++ b/pkg/mod.py
@@ -1,2 +1,2 @@
 x = 1
-a = 1
+a = 2
""",
    "Add-new.patch": """--- /dev/null
+++ b/pkg/new.py
@@ -0,0 +1 @@
+b = 1
""",
    "Docs-only.patch": """--- a/docs/notes.txt
+++ b/docs/notes.txt
@@ -1 +1 @@
-old
+new
""",
}
TESTS = """
import pytest

def test_a_exists():
    from pkg.mod import a  # noqa: F401

def test_a_is_two():
    from pkg.mod import a
    assert a == 2

def test_b():
    from pkg.new import b
    assert b == 1

@pytest.mark.regression
def test_x_needs_nothing():
    from pkg.mod import x
    assert x == 1
"""


def setup(tmp_path: Path, names: list[str], extra: dict[str, str] | None = None) -> list[str]:
    """A series of ``names``, from PATCHES or ``extra`` (a test's own patches)."""
    texts = {**PATCHES, **(extra or {})}
    for root in ("source", "site"):
        (tmp_path / root / "pkg").mkdir(parents=True)
        (tmp_path / root / "pkg" / "__init__.py").write_text("")
        (tmp_path / root / "pkg" / "mod.py").write_text("x = 1\n")
    (tmp_path / "source" / "docs").mkdir()
    (tmp_path / "source" / "docs" / "notes.txt").write_text("old\n")
    patches = tmp_path / "patches"
    patches.mkdir()
    for name in names:
        (patches / name).write_text(texts[name])
    (patches / "series").write_text("".join(f"{n}\n" for n in names))
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_pkg.py").write_text(TESTS)
    # Without Add-new.patch this module fails to import; the other module's
    # tests must still run (and not count as needing that patch).
    (tmp_path / "tests" / "test_new.py").write_text(
        "from pkg.new import b\n\ndef test_b_at_import():\n    assert b == 1\n")
    return ["--series", str(patches / "series"), "--source", str(tmp_path / "source"),
            "--site", str(tmp_path / "site"), "--python", sys.executable,
            "--out", str(tmp_path / "out"), str(tmp_path / "tests")]


def test_matrix_names_what_each_patch_is_needed_for(tmp_path: Path):
    proc = run_tool("loo", *setup(tmp_path, list(PATCHES)))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "out" / "loo.json").read_text())
    needs = {n: sorted(t.rsplit("::", 1)[1] for t in e["needs"])
             for n, e in result["patches"].items()}
    # test_a_is_two needs Add-a and Bump-a together: it is Bump-a's, and
    # Add-a, measured on the series without Bump-a, counts only its own.
    assert needs == {
        "Add-a.patch": ["test_a_exists"],
        "Bump-a.patch": ["test_a_is_two"],
        "Add-new.patch": ["test_b", "test_b_at_import"],
        "Docs-only.patch": [],
    }
    assert result["patches"]["Add-a.patch"]["dropped"] == ["Bump-a.patch"]
    assert all(not e["dropped"] for n, e in result["patches"].items() if n != "Add-a.patch")
    assert result["tests_run"] == 5 and result["failing_with_whole_series"] == []
    assert result["unmarked_and_needing_no_patch"] == []
    assert result["marked_regression_but_failing_on_stock"] == []
    assert "no test needs: Docs-only.patch" in proc.stdout
    table = (tmp_path / "out" / "loo.md").read_text()
    assert "| Add-a.patch | left out before its dependants | Bump-a.patch | 1 |" in table
    assert "| Docs-only.patch | left out | - | **none** |" in table
    # The overlays were copies: the site itself is untouched.
    assert (tmp_path / "site" / "pkg" / "mod.py").read_text() == "x = 1\n"
    assert not (tmp_path / "site" / "pkg" / "new.py").exists()


def test_exit_zero_when_every_patch_is_needed(tmp_path: Path):
    proc = run_tool("loo", *setup(tmp_path, ["Add-a.patch", "Bump-a.patch", "Add-new.patch"]))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "every patch of 3 is needed" in proc.stdout


def test_a_series_that_does_not_apply_is_refused(tmp_path: Path):
    proc = run_tool("loo", *setup(tmp_path, ["Bump-a.patch"]))
    assert proc.returncode == 1
    assert "the whole series does not apply" in proc.stderr


def test_wrong_regression_markers_are_listed(tmp_path: Path):
    args = setup(tmp_path, ["Add-a.patch", "Bump-a.patch", "Add-new.patch"])
    (tmp_path / "tests" / "test_markers.py").write_text(
        "import pytest\n\n"
        "def test_unmarked_needs_nothing():\n    from pkg.mod import x\n\n"
        "@pytest.mark.regression\n"
        "def test_marked_but_needs_a():\n    from pkg.mod import a  # noqa: F401\n")
    proc = run_tool("loo", *args)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "out" / "loo.json").read_text())
    names = {k: [t.rsplit("::", 1)[1] for t in result[k]]
             for k in ("unmarked_and_needing_no_patch", "marked_regression_but_failing_on_stock")}
    assert names == {"unmarked_and_needing_no_patch": ["test_unmarked_needs_nothing"],
                     "marked_regression_but_failing_on_stock": ["test_marked_but_needs_a"]}


# Add-c adds `c` to pkg/other.py; Add-d adds `d` two lines below, with `c`'s
# line in its context, so without Add-c it no longer applies strictly. Its
# change does not touch Add-c's lines: reverting Add-c alone is clean.
OTHER = "".join(f"x{i} = {i}\n" for i in range(1, 7))
REVERTIBLE = {
    "Add-c.patch": """--- a/pkg/other.py
+++ b/pkg/other.py
@@ -1,4 +1,5 @@
 x1 = 1
+c = 1
 x2 = 2
 x3 = 3
 x4 = 4
""",
    "Add-d.patch": """--- a/pkg/other.py
+++ b/pkg/other.py
@@ -2,6 +2,7 @@ x1 = 1
 c = 1
 x2 = 2
 x3 = 3
+d = 1
 x4 = 4
 x5 = 5
 x6 = 6
""",
}
# Add-f adds `f` on the line right after Add-e's `e`: git's three-way revert
# of Add-e conflicts (neighbouring edits), and removing Add-e's line where it
# stands resolves it.
THIRD = "".join(f"y{i} = {i}\n" for i in range(1, 5))
REVERTIBLE.update({
    "Add-e.patch": """--- a/pkg/third.py
+++ b/pkg/third.py
@@ -1,3 +1,4 @@
 y1 = 1
+e = 1
 y2 = 2
 y3 = 3
""",
    "Add-f.patch": """--- a/pkg/third.py
+++ b/pkg/third.py
@@ -1,4 +1,5 @@
 y1 = 1
 e = 1
+f = 1
 y2 = 2
 y3 = 3
""",
})
REVERTIBLE_TESTS = """
def test_e():
    from pkg.third import e
    assert e == 1

def test_f():
    from pkg.third import f
    assert f == 1

def test_c():
    from pkg.other import c
    assert c == 1

def test_d():
    from pkg.other import d
    assert d == 1
"""


def test_a_patch_later_ones_build_on_is_reverted_alone(tmp_path: Path):
    """Leaving Add-c out would drop Add-d too and count test_d for Add-c;
    reverting Add-c's hunks on the fully patched file keeps Add-d, so only
    Add-c's own test needs it. Where the revert conflicts (Bump-a rewrites
    the line Add-a added), Add-a is measured on the series without Bump-a."""
    args = setup(tmp_path, ["Add-a.patch", "Bump-a.patch", "Add-c.patch", "Add-d.patch",
                            "Add-e.patch", "Add-f.patch"], REVERTIBLE)
    for root in ("source", "site"):
        (tmp_path / root / "pkg" / "other.py").write_text(OTHER)
        (tmp_path / root / "pkg" / "third.py").write_text(THIRD)
    (tmp_path / "tests" / "test_other.py").write_text(REVERTIBLE_TESTS)
    (tmp_path / "tests" / "test_new.py").unlink()
    proc = run_tool("loo", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "out" / "loo.json").read_text())
    entries = result["patches"]
    needs = {n: sorted(t.rsplit("::", 1)[1] for t in e["needs"]) for n, e in entries.items()}
    assert needs["Add-c.patch"] == ["test_c"]
    assert entries["Add-c.patch"]["method"] == "reverted"
    assert entries["Add-c.patch"]["dropped"] == []
    assert needs["Add-d.patch"] == ["test_d"]
    assert needs["Add-e.patch"] == ["test_e"]
    assert entries["Add-e.patch"]["method"] == "reverted"
    assert needs["Add-f.patch"] == ["test_f"]
    assert entries["Add-d.patch"]["method"] == "left out"
    assert entries["Add-a.patch"]["method"] == "left out before its dependants"
    assert entries["Add-a.patch"]["dropped"] == ["Bump-a.patch"]
    assert needs["Add-a.patch"] == ["test_a_exists"]
    assert "without Bump-a.patch only (keeping Add-a.patch)" in proc.stdout
    assert "counted with later patches" not in proc.stdout
    table = (tmp_path / "out" / "loo.md").read_text()
    assert "| Add-c.patch | reverted | - | 1 |" in table
    # The source and site are untouched.
    assert (tmp_path / "site" / "pkg" / "other.py").read_text() == OTHER


def test_only_measures_the_named_patches_and_merges_the_rest(tmp_path: Path):
    args = setup(tmp_path, ["Add-a.patch", "Bump-a.patch", "Add-new.patch"])
    first = run_tool("loo", *args)
    assert first.returncode == 0, first.stdout + first.stderr
    previous = tmp_path / "previous.json"
    previous.write_text((tmp_path / "out" / "loo.json").read_text())
    proc = run_tool("loo", "--only", "Bump-a.patch", "--merge", str(previous), *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "without Bump-a.patch" in proc.stdout
    assert "without Add-a.patch" not in proc.stdout
    result = json.loads((tmp_path / "out" / "loo.json").read_text())
    assert list(result["patches"]) == ["Add-a.patch", "Bump-a.patch", "Add-new.patch"]
    assert result["command"].startswith("python -m tools.loo ")
    assert result["command"].endswith(" --only Bump-a.patch")
    assert result["patches"]["Bump-a.patch"]["measured_by"] == result["command"]
    old_command = json.loads(previous.read_text())["command"]
    assert result["patches"]["Add-a.patch"]["measured_by"] == old_command
    unknown = run_tool("loo", "--only", "Nope.patch", *args)
    assert unknown.returncode == 1 and "Nope.patch" in unknown.stderr


# Add-g writes `g` (rewritten by Bump-g, so reverting Add-g conflicts) and `h`
# (which Bump-g takes away again). Add-i's context spans where `h` stood: it
# applies without Add-g and with the whole series, but not on the series
# without Bump-g, so Add-g cannot be measured before its dependant.
FOURTH = "".join(f"z{i} = {i}\n" for i in range(1, 9))
ENTANGLED = {
    "Add-g.patch": """--- a/pkg/fourth.py
+++ b/pkg/fourth.py
@@ -2,2 +2,3 @@ z1 = 1
 z2 = 2
+h = 1
 z3 = 3
@@ -6,2 +7,3 @@ z5 = 5
 z6 = 6
+g = 1
 z7 = 7
""",
    "Bump-g.patch": """--- a/pkg/fourth.py
+++ b/pkg/fourth.py
@@ -2,3 +2,2 @@ z1 = 1
 z2 = 2
-h = 1
 z3 = 3
@@ -7,3 +6,3 @@ z5 = 5
 z6 = 6
-g = 1
+g = 2
 z7 = 7
""",
    "Add-i.patch": """--- a/pkg/fourth.py
+++ b/pkg/fourth.py
@@ -2,2 +2,3 @@ z1 = 1
 z2 = 2
+i = 1
 z3 = 3
""",
}


def test_a_patch_measured_with_its_dependants_when_nothing_else_applies(tmp_path: Path):
    args = setup(tmp_path, ["Add-new.patch", *ENTANGLED], ENTANGLED)
    for root in ("source", "site"):
        (tmp_path / root / "pkg" / "fourth.py").write_text(FOURTH)
    (tmp_path / "tests" / "test_fourth.py").write_text(
        "from pkg import fourth\n\n"
        "def test_g_is_two():\n    assert fourth.g == 2\n\n"
        "def test_no_h():\n    assert not hasattr(fourth, 'h')\n\n"
        "def test_i():\n    assert fourth.i == 1\n")
    (tmp_path / "tests" / "test_pkg.py").unlink()
    proc = run_tool("loo", *args)
    result = json.loads((tmp_path / "out" / "loo.json").read_text())
    entry = result["patches"]["Add-g.patch"]
    assert entry["method"] == "left out with later patches", proc.stdout
    assert entry["dropped"] == ["Bump-g.patch"]
    assert sorted(t.rsplit("::", 1)[1] for t in entry["needs"]) == ["test_g_is_two"]
    assert "counted with later patches (their revert conflicts): Add-g.patch" in proc.stdout
    assert "keeping Add-g.patch" not in proc.stdout


# Add-mod creates pkg/added.py; Edit-mod edits it. Reverting Add-mod on the
# whole series is a modify/delete conflict with no markers in the file: the
# file must not count as reverted (it would still hold everything).
ADDED = {
    "Add-mod.patch": """--- /dev/null
+++ b/pkg/added.py
@@ -0,0 +1,2 @@
+m = 1
+n = 1
""",
    "Edit-mod.patch": """--- a/pkg/added.py
+++ b/pkg/added.py
@@ -1,2 +1,2 @@
 m = 1
-n = 1
+n = 2
""",
}


def test_a_created_file_a_later_patch_edits_is_not_taken_as_reverted(tmp_path: Path):
    args = setup(tmp_path, list(ADDED), ADDED)
    (tmp_path / "tests" / "test_pkg.py").write_text(
        "def test_m():\n    from pkg.added import m\n    assert m == 1\n\n"
        "def test_n_is_two():\n    from pkg.added import n\n    assert n == 2\n")
    (tmp_path / "tests" / "test_new.py").unlink()
    proc = run_tool("loo", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    entries = json.loads((tmp_path / "out" / "loo.json").read_text())["patches"]
    assert entries["Add-mod.patch"]["method"] == "left out before its dependants"
    assert entries["Add-mod.patch"]["dropped"] == ["Edit-mod.patch"]
    assert [t.rsplit("::", 1)[1] for t in entries["Add-mod.patch"]["needs"]] == ["test_m"]
    assert [t.rsplit("::", 1)[1] for t in entries["Edit-mod.patch"]["needs"]] == ["test_n_is_two"]
