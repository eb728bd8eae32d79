# SPDX-License-Identifier: Apache-2.0
"""tools.fetch against a local simple index serving good and tampered files."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from stack_tooling import run_tool

GOOD = b"the pinned artifact\n" * 100
NAME = "fakeproj-1.0.tar.gz"


@pytest.fixture
def index(tmp_path: Path):
    """A PEP 503 index on disk, a pin naming GOOD's digest, an empty cache."""
    (tmp_path / "idx" / "fakeproj").mkdir(parents=True)
    (tmp_path / "files").mkdir()
    (tmp_path / "idx" / "fakeproj" / "index.html").write_text(
        f'<html><body><a href="../../files/{NAME}#sha256=x">{NAME}</a></body></html>\n'
    )
    pin = tmp_path / "pin.toml"
    pin.write_text(
        '[upstream]\nproject = "fakeproj"\nversion = "1.0"\ntag = "v1.0"\n'
        f'[artifacts.sdist]\nproject = "fakeproj"\nfilename = "{NAME}"\n'
        f'sha256 = "{hashlib.sha256(GOOD).hexdigest()}"\n'
    )
    env = {
        "PIP_INDEX_URL": (tmp_path / "idx").as_uri() + "/",
        "VLLM_EAGLE3_CACHE": str(tmp_path / "cache"),
        "VLLM_EAGLE3_OFFLINE": "0",
    }
    return tmp_path, pin, env


def serve(tmp_path: Path, data: bytes) -> None:
    (tmp_path / "files" / NAME).write_bytes(data)


def test_good_download_is_verified_and_cached(index):
    tmp_path, pin, env = index
    serve(tmp_path, GOOD)
    proc = run_tool("fetch", "sdist", "--pin", str(pin), env=env)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "cache" / NAME).read_bytes() == GOOD
    # Second run: from the cache, even with the index gone.
    (tmp_path / "files" / NAME).unlink()
    proc = run_tool("fetch", "sdist", "--pin", str(pin), "--offline", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "verified" in proc.stdout


def test_tampered_download_is_rejected(index):
    tmp_path, pin, env = index
    bad = GOOD.replace(b"pinned", b"swapped")
    serve(tmp_path, bad)
    proc = run_tool("fetch", "sdist", "--pin", str(pin), env=env)
    assert proc.returncode == 1
    expected = hashlib.sha256(GOOD).hexdigest()
    actual = hashlib.sha256(bad).hexdigest()
    assert NAME in proc.stderr and expected in proc.stderr and actual in proc.stderr
    assert not (tmp_path / "cache" / NAME).exists()  # never used
    kept = list((tmp_path / "cache" / "rejected").iterdir())
    assert [p.read_bytes() for p in kept] == [bad]  # kept for inspection


def test_tampered_cache_is_moved_aside_not_deleted(index):
    tmp_path, pin, env = index
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / NAME).write_bytes(b"edited by hand")
    serve(tmp_path, GOOD)
    proc = run_tool("fetch", "sdist", "--pin", str(pin), env=env)
    assert proc.returncode == 0, proc.stderr
    assert "not used, moved aside" in proc.stdout
    assert (tmp_path / "cache" / NAME).read_bytes() == GOOD
    kept = list((tmp_path / "cache" / "rejected").iterdir())
    assert [p.read_bytes() for p in kept] == [b"edited by hand"]


def test_offline_without_cache_says_what_and_how(index):
    tmp_path, pin, env = index
    serve(tmp_path, GOOD)
    proc = run_tool("fetch", "sdist", "--pin", str(pin), "--offline", env=env)
    assert proc.returncode == 1
    assert f"offline, and {NAME}" in proc.stderr
    assert str(tmp_path / "cache") in proc.stderr
    assert "python -m tools.fetch sdist" in proc.stderr
    assert not (tmp_path / "cache" / NAME).exists()


def test_offline_build_without_cache_fails_clearly(tmp_path: Path):
    """./build.sh --offline on a machine whose cache is empty."""
    import os
    import subprocess

    from stack_tooling import REPO_ROOT

    proc = subprocess.run(
        [str(REPO_ROOT / "build.sh"), "--offline", "--cpu"],
        capture_output=True, text=True,
        env={**os.environ, "VLLM_EAGLE3_CACHE": str(tmp_path / "empty-cache")},
    )
    assert proc.returncode != 0
    assert "offline, and vllm-0.16.0.tar.gz" in proc.stderr
    assert "is not in the cache" in proc.stderr
