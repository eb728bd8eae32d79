# SPDX-License-Identifier: Apache-2.0
"""prepare.py --site: the carried wheels unpacked into one archive lay out
what ``pip install --no-deps --target`` would (checked against pip itself)."""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile

import gpu_e2e_helpers  # noqa: F401 - puts tools/gpu_harness on sys.path
import prepare


def _wheel(path, name, files):
    dist = f"{name}-1.0.dist-info"
    files = {**files, f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{f},,\n" for f in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for f, text in {**files, f"{dist}/RECORD": record}.items():
            z.writestr(f, text)
    return path


def _tree(root):
    # pip adds INSTALLER / REQUESTED and rewrites RECORD; scripts go to bin/.
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*")
            if p.is_file() and ".dist-info" not in str(p) and p.parts[len(root.parts)] != "bin"}


def test_site_archive_lays_out_what_pip_does(tmp_path):
    wheels = [
        _wheel(tmp_path / "alpha-1.0-py3-none-any.whl", "alpha",
               {"alpha/__init__.py": "A = 1\n", "alpha/sub/x.py": "X = 2\n"}),
        _wheel(tmp_path / "beta-1.0-py3-none-any.whl", "beta",
               {"beta.py": "B = 3\n", "beta-1.0.data/purelib/beta_extra.py": "E = 4\n",
                "beta-1.0.data/scripts/beta-cli": "#!python\nprint(5)\n"}),
    ]
    out = prepare.pack_site(wheels, tmp_path / "site" / "site.tar.xz")
    ours = tmp_path / "ours"
    with tarfile.open(out) as t:
        t.extractall(ours, filter="data")
    pips = tmp_path / "pip"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", str(pips), *map(str, wheels)], check=True)
    assert _tree(ours) == _tree(pips)
    assert (ours / "beta_extra.py").is_file() and not list(ours.glob("*.data"))
