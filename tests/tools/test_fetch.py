# SPDX-License-Identifier: Apache-2.0
"""tools.fetch against a local simple index serving good and tampered files."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from stack_tooling import REPO_ROOT, run_tool

GOOD = b"the pinned artifact\n" * 100
NAME = "fakeproj-1.0.tar.gz"


@pytest.fixture
def fetch(tmp_path: Path):
    """``fetch(data, *args)``: serve ``data`` as NAME from a PEP 503 index on
    disk (None: serve nothing) and run the tool with a pin naming GOOD's
    digest and a cache under tmp_path."""
    (tmp_path / "idx" / "fakeproj").mkdir(parents=True)
    (tmp_path / "files").mkdir()
    (tmp_path / "idx" / "fakeproj" / "index.html").write_text(
        f'<html><body><a href="../../files/{NAME}#sha256=x">{NAME}</a></body></html>\n')
    pin = tmp_path / "pin.toml"
    pin.write_text(
        '[upstream]\nproject = "fakeproj"\nversion = "1.0"\ntag = "v1.0"\n'
        f'[artifacts.sdist]\nproject = "fakeproj"\nfilename = "{NAME}"\n'
        f'sha256 = "{hashlib.sha256(GOOD).hexdigest()}"\n')
    env = {"PIP_INDEX_URL": (tmp_path / "idx").as_uri() + "/",
           "VLLM_EAGLE3_CACHE": str(tmp_path / "cache"), "VLLM_EAGLE3_OFFLINE": "0"}

    def run(data: bytes | None, *args: str):
        (tmp_path / "files" / NAME).unlink(missing_ok=True)
        if data is not None:
            (tmp_path / "files" / NAME).write_bytes(data)
        return run_tool("fetch", "sdist", "--pin", str(pin), *args, env=env)

    return run


def rejected(tmp_path: Path) -> list[bytes]:
    return [p.read_bytes() for p in (tmp_path / "cache" / "rejected").iterdir()]


def test_good_download_is_verified_and_cached(fetch, tmp_path: Path):
    proc = fetch(GOOD)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "cache" / NAME).read_bytes() == GOOD
    # Second run: from the cache, even with the index gone.
    proc = fetch(None, "--offline")
    assert proc.returncode == 0, proc.stderr
    assert "verified" in proc.stdout


def test_tampered_download_is_rejected(fetch, tmp_path: Path):
    bad = GOOD.replace(b"pinned", b"swapped")
    proc = fetch(bad)
    assert proc.returncode == 1
    for word in (NAME, hashlib.sha256(GOOD).hexdigest(), hashlib.sha256(bad).hexdigest()):
        assert word in proc.stderr
    assert not (tmp_path / "cache" / NAME).exists()  # never used
    assert rejected(tmp_path) == [bad]  # kept for inspection


def test_tampered_cache_is_moved_aside_not_deleted(fetch, tmp_path: Path):
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / NAME).write_bytes(b"edited by hand")
    proc = fetch(GOOD)
    assert proc.returncode == 0, proc.stderr
    assert "not used, moved aside" in proc.stdout
    assert (tmp_path / "cache" / NAME).read_bytes() == GOOD
    assert rejected(tmp_path) == [b"edited by hand"]


def test_offline_without_cache_says_what_and_how(fetch, tmp_path: Path):
    proc = fetch(GOOD, "--offline")
    assert proc.returncode == 1
    for words in (f"offline, and {NAME}", str(tmp_path / "cache"), "python -m tools.fetch sdist"):
        assert words in proc.stderr
    assert not (tmp_path / "cache" / NAME).exists()


def test_offline_build_without_cache_fails_clearly(tmp_path: Path):
    """./build.sh --offline on a machine whose cache is empty."""
    proc = subprocess.run([str(REPO_ROOT / "build.sh"), "--offline", "--cpu"],
                          capture_output=True, text=True,
                          env={**os.environ, "VLLM_EAGLE3_CACHE": str(tmp_path / "empty-cache")})
    assert proc.returncode != 0
    assert "offline, and vllm-0.16.0.tar.gz" in proc.stderr
    assert "is not in the cache" in proc.stderr
