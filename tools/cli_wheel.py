"""Build the small wheel of the ``vllm-eagle3`` command (tools/vllm_eagle3).

    python -m tools.cli_wheel [--dist dist]

dist/vllm_eagle3-<version>-py3-none-any.whl: the package, a console script
``vllm-eagle3``, and ``Requires-Dist: vllm==0.16.0`` (the pinned release; the
series' wheel, 0.16.0+eagle3.<id>, satisfies it). Its version is the series
wheel's, so the two name the same series. Pure Python; every entry is
stamped with one fixed date and written in sorted order, so the same sources
give the same wheel, byte for byte (./build.sh runs it after the big wheel,
which it leaves alone).
"""

from __future__ import annotations

import base64
import hashlib
import io
import zipfile
from pathlib import Path

from tools._common import REPO_ROOT, load_pin, parser, run_main, say
from tools.build_wheel import stack_version

TOOL = "cli_wheel"
PACKAGE = REPO_ROOT / "tools" / "vllm_eagle3"
NAME = "vllm_eagle3"
STAMP = (1980, 1, 1, 0, 0, 0)  # the zip format's earliest date: no build time leaks in
SUMMARY = ("The drafter tools of the EAGLE-3 series for vLLM 0.16.0: doctor, show, check, "
           "convert, calibrate")


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def files(version: str, vllm_version: str) -> dict[str, bytes]:
    """Every entry of the wheel but RECORD, by archive name."""
    out = {f"{NAME}/{p.name}": p.read_bytes() for p in sorted(PACKAGE.glob("*.py"))}
    info = f"{NAME}-{version}.dist-info"
    out[f"{info}/METADATA"] = (
        "Metadata-Version: 2.1\n"
        f"Name: vllm-eagle3\nVersion: {version}\nSummary: {SUMMARY}\n"
        "License: Apache-2.0\nRequires-Python: >=3.11\n"
        f"Requires-Dist: vllm=={vllm_version}\n").encode()
    out[f"{info}/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: vllm-eagle3 tools/cli_wheel.py\n"
        "Root-Is-Purelib: true\nTag: py3-none-any\n").encode()
    out[f"{info}/entry_points.txt"] = (
        "[console_scripts]\nvllm-eagle3 = vllm_eagle3.cli:console\n").encode()
    out[f"{info}/top_level.txt"] = f"{NAME}\n".encode()
    return out


def build(dist_dir: Path) -> Path:
    pin = load_pin()
    version = stack_version(pin, cpu=False)
    entries = files(version, pin.version)
    record_name = f"{NAME}-{version}.dist-info/RECORD"
    record = "".join(_record_line(n, d) + "\n" for n, d in entries.items())
    entries[record_name] = (record + f"{record_name},,\n").encode()
    dist_dir.mkdir(parents=True, exist_ok=True)
    dest = dist_dir / f"{NAME}-{version}-py3-none-any.whl"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in entries.items():  # RECORD last, as installers expect
            zi = zipfile.ZipInfo(name, date_time=STAMP)
            zi.compress_type = zipfile.ZIP_DEFLATED
            zi.external_attr = 0o644 << 16
            z.writestr(zi, data)
    dest.write_bytes(buf.getvalue())
    say(TOOL, f"wrote {dest.relative_to(REPO_ROOT) if dest.is_relative_to(REPO_ROOT) else dest}"
        f" ({len(entries)} entries, requires vllm=={pin.version})")
    return dest


def main() -> int:
    ap = parser(TOOL, __doc__)
    ap.add_argument("--dist", type=Path, default=REPO_ROOT / "dist")
    build(ap.parse_args().dist)
    return 0


if __name__ == "__main__":
    run_main(TOOL, main)
