#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Stage what the GPU harness carries to the lent device (run on this machine).

1. vLLM's Python files: taken from the pinned, sha256-verified official
   v0.16.0 CUDA wheel (pin.toml, artifacts.wheel-x86_64), every ``.so`` left
   out, with the files ``patches/series`` touches as tools.build_wheel patches
   them (tools.apply, no fuzz, no offset; ``--stock`` skips the series;
   ``--without NAME`` applies the series minus that patch
   and writes ``.device/vllm/vllm-py-without-<stem>.tar.xz`` next to the
   full one, which device_setup.sh unpacks when VLLM_TARBALL names it).
   Packed as ``.device/vllm/vllm-py.tar.xz`` with a
   manifest (``vllm/_gpu_harness_manifest.json``: wheel digest, series and
   per-patch digests) so every device log says what it ran.
2. The carried wheels: exactly the pins in
   ``tools/gpu_harness/wheels.txt`` (or ``--wheel-list``), cp312
   manylinux x86_64, in ``.device/whl`` (downloaded with ``pip download
   --no-deps --only-binary=:all:`` when missing).

3. With ``--site``, the same wheels unpacked as ``pip install --target``
   lays them out and packed as ``.device/site/site.tar.xz`` (25 MiB instead
   of 48: zip compresses file by file). Carry ``.device/site`` instead of
   ``.device/whl`` to leave room for trained pairs (device_setup.sh unpacks
   it when present).

4. From the device cache (``device_cache.py``), where their keys match:
   FlashInfer's JIT cache into ``.device/fi-jit`` and the serving suite's
   trained pairs into ``.device/pairs``, each with its key file; each line
   says what was laid, or which input changed.

``.device/`` is git-ignored; name ``.device/whl`` and ``.device/vllm`` in the
device call's ``carry``, with ``.device/kernels`` (the kernel sources of
``kernels.py stage``, and the ``kernels-libs.tar.xz`` a build returns). The DSA
stand-ins, their start-up hook and the xgrammar placeholder travel with the
working tree; ``tools/gpu_harness/device_setup.sh`` installs them.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from tools._common import load_pin  # noqa: E402

DEVICE_DIR = REPO_ROOT / ".device"
DEFAULT_WHEEL_LIST = [Path(__file__).resolve().parent / "wheels.txt"]
CARRY_LIMIT = 64 * 2**20
PLATFORMS = [
    "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64",
    "manylinux_2_24_x86_64", "manylinux_2_27_x86_64", "manylinux_2_28_x86_64",
    "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64",
]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def find_wheel() -> tuple[Path, str]:
    """The pinned official CUDA wheel, fetched and verified by tools.fetch."""
    from tools.fetch import ensure, offline_default

    wheel = ensure(load_pin().artifact("wheel-x86_64"), offline=offline_default())
    return wheel, sha256(wheel)


def find_sdist() -> Path:
    from tools.fetch import ensure, offline_default

    return ensure(load_pin().artifact("sdist"), offline=offline_default())


def stage_vllm(wheel: Path, wheel_digest: str, stock: bool, out: Path,
               without: str | None = None) -> dict:
    """vLLM's Python files from the official wheel (no .so), the series'
    files replaced by the ones tools.build_wheel patches (the stack's one
    applier), packed with a manifest."""
    from tools._common import SERIES_FILE, read_series
    from tools.build_wheel import stage_patched

    names = [] if stock else read_series(SERIES_FILE)
    if without is not None:
        if without not in names:
            raise SystemExit(f"--without {without}: not in patches/series")
        names.remove(without)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "tree"
        with zipfile.ZipFile(wheel) as zf:
            members = [
                m for m in zf.namelist()
                if not m.endswith("/") and ".so" not in Path(m).name
                and (m.startswith("vllm/") or m.startswith("vllm-0.16.0.dist-info/"))
            ]
            zf.extractall(root, members)
        if names:
            series = Path(tmp) / "patches" / "series"
            series.parent.mkdir()
            for name in names:
                (series.parent / name).write_bytes((SERIES_FILE.parent / name).read_bytes())
            series.write_text("".join(f"{n}\n" for n in names))
            for path, data in stage_patched(find_sdist(), series, Path(tmp) / "stage").items():
                if not path.startswith("vllm/"):
                    continue  # upstream's tests/ does not ship
                (root / path).unlink(missing_ok=True)
                if data is not None:
                    (root / path).parent.mkdir(parents=True, exist_ok=True)
                    (root / path).write_bytes(data)
        applied = [{"patch": n, "sha256": sha256(SERIES_FILE.parent / n)} for n in names]
        manifest = {
            "wheel": wheel.name,
            "wheel_sha256": wheel_digest,
            "variant": "stock" if stock else (f"patched-without-{without}" if without else "patched"),
            "series": applied,
            "series_sha256": hashlib.sha256(
                "".join(p["sha256"] for p in applied).encode()
            ).hexdigest() if applied else None,
        }
        (root / "vllm" / "_gpu_harness_manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        out.parent.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:xz", preset=6) as tf:
            for p in sorted(root.rglob("*")):
                if p.is_file():
                    ti = tf.gettarinfo(str(p), arcname=str(p.relative_to(root)))
                    ti.uid = ti.gid = 0
                    ti.uname = ti.gname = ""
                    ti.mtime = 0
                    with p.open("rb") as f:
                        tf.addfile(ti, f)
        out.write_bytes(buf.getvalue())
        return manifest


def wheel_pins(path: Path) -> list[tuple[str, str]]:
    pins = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins.append((name.strip(), version.strip()))
    return pins


def _norm(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def stage_wheels(list_path: Path, whl_dir: Path, download: bool) -> list[Path]:
    whl_dir.mkdir(parents=True, exist_ok=True)
    pins = wheel_pins(list_path)
    have = {}
    for w in whl_dir.glob("*.whl"):
        dist, version = w.name.split("-")[:2]
        have.setdefault(_norm(dist), []).append((version, w))
    wanted, missing = [], []
    for name, version in pins:
        match = [w for v, w in have.get(_norm(name), []) if v == version]
        if match:
            wanted.append(match[0])
        else:
            missing.append(f"{name}=={version}")
    if missing and download:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", "-d", str(whl_dir)]
        for p in PLATFORMS:
            cmd += ["--platform", p]
        subprocess.run(cmd + missing, check=True)
        return stage_wheels(list_path, whl_dir, download=False)
    if missing:
        raise SystemExit(f"missing wheels in {whl_dir}: {missing}")
    extra = sorted(set(whl_dir.glob("*.whl")) - set(wanted))
    if extra:
        raise SystemExit(f"{whl_dir} holds wheels not in {list_path}: {[e.name for e in extra]}")
    return wanted


def pack_site(wheels: list[Path], out: Path) -> Path:
    """The wheels unpacked as ``pip install --no-deps --target`` does (a
    wheel's ``*.data/purelib`` and ``platlib`` at the top; its scripts,
    headers and data left out, as nothing imports them), one tar.xz."""
    import shutil
    import tempfile
    import zipfile

    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        for w in wheels:
            with zipfile.ZipFile(w) as z:
                z.extractall(site)
        for data in site.glob("*.data"):
            for lib in ("purelib", "platlib"):
                if (data / lib).is_dir():
                    shutil.copytree(data / lib, site, dirs_exist_ok=True)
            shutil.rmtree(data)
        out.parent.mkdir(parents=True, exist_ok=True)
        # xz -T0: the stdlib's lzma packs 200 MB on one core.
        tar = subprocess.Popen(["tar", "-C", str(site), "-cf", "-", "."], stdout=subprocess.PIPE)
        with open(out, "wb") as f:
            subprocess.run(["xz", "-T0", "-6"], stdin=tar.stdout, stdout=f, check=True)
        if tar.wait() != 0:
            raise SystemExit(f"tar of {site} failed")
    return out


def lay_cached() -> None:
    """FlashInfer's JIT cache and the serving suite's trained pairs, from the
    device cache where their keys match (device_cache.py); what is not laid,
    the device makes once."""
    from tools.gpu_harness import device_cache

    for kind in ("fi-jit", "pair-dsv3", "pair-kimi"):
        print(f"[prepare] {device_cache.lay(kind, device_cache.inputs(kind, REPO_ROOT), REPO_ROOT)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stock", action="store_true", help="do not apply patches/series")
    ap.add_argument("--wheel-list", type=Path, help="pins of the carried wheels")
    ap.add_argument("--no-download", action="store_true")
    ap.add_argument("--without", metavar="PATCH",
                    help="also stage the series minus this patch (file name in patches/series)")
    ap.add_argument("--site", action="store_true",
                    help="also pack the wheels as .device/site/site.tar.xz (carry it instead of .device/whl)")
    args = ap.parse_args(argv)

    wheel, digest = find_wheel()
    manifest = stage_vllm(wheel, digest, args.stock, DEVICE_DIR / "vllm" / "vllm-py.tar.xz")
    print(json.dumps(manifest, indent=2))
    extra_tar = []
    if args.without:
        stem = Path(args.without).stem
        t = DEVICE_DIR / "vllm" / f"vllm-py-without-{stem}.tar.xz"
        m2 = stage_vllm(wheel, digest, False, t, without=args.without)
        print("also staged", t.name, "variant", m2["variant"])
        extra_tar.append(t)

    wl = args.wheel_list or next((p for p in DEFAULT_WHEEL_LIST if p.is_file()), None)
    if wl is None:
        raise SystemExit("tools/gpu_harness/wheels.txt not found; pass --wheel-list")
    wheels = stage_wheels(wl, DEVICE_DIR / "whl", download=not args.no_download)
    lay_cached()

    sizes = {
        ".device/vllm": sum(t.stat().st_size for t in [DEVICE_DIR / "vllm" / "vllm-py.tar.xz", *extra_tar]),
        **{f".device/{d}": sum(f.stat().st_size for f in (DEVICE_DIR / d).iterdir())
           for d in ("fi-jit", "pairs") if (DEVICE_DIR / d).is_dir()},
    }
    site = DEVICE_DIR / "site" / "site.tar.xz"
    if args.site:
        sizes[".device/site"] = pack_site(wheels, site).stat().st_size
    else:
        # device_setup.sh prefers a carried site archive: never leave one
        # older than the wheels just staged.
        site.unlink(missing_ok=True)
        sizes[".device/whl"] = sum(w.stat().st_size for w in wheels)
    tracked = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=REPO_ROOT, capture_output=True, check=True,
    ).stdout.split(b"\0")
    tree = sum((REPO_ROOT / p.decode()).stat().st_size for p in tracked if p and (REPO_ROOT / p.decode()).is_file())
    total = tree + sum(sizes.values())
    for k, v in sizes.items():
        print(f"{k}: {v / 2**20:.1f} MiB")
    print(f"working tree: {tree / 2**20:.1f} MiB; total carried: {total / 2**20:.1f} MiB "
          f"(limit {CARRY_LIMIT / 2**20:.0f} MiB)")
    if total > CARRY_LIMIT:
        raise SystemExit("over the device's 64 MiB carry limit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
