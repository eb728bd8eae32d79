#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The device's slow artifacts, made once: a content key each, a cache outside git.

    python3 tools/gpu_harness/device_cache.py key [KIND...]     each key and the inputs it is made of
    python3 tools/gpu_harness/device_cache.py put DIR          store what a device call returned
    python3 tools/gpu_harness/device_cache.py import-shared DIR --built-at COMMIT --torch VERSION
    python3 tools/gpu_harness/device_cache.py list
    python3 tools/gpu_harness/device_cache.py check-laid --torch VERSION       (on the device)
    python3 tools/gpu_harness/device_cache.py seal --out DIR --torch VERSION FILE...   (on the device)

Three kinds of artifact take minutes to make on a fresh device; each gets a
key, the sha256 of the digests of everything that goes into it:

* ``kernels``: ``kernels-libs.tar.xz`` (kernels.py build): the staged sdist
  subset and the CUTLASS wheel (``.device/kernels/sources.json``), the build
  side of kernels.py (the file without its docstring, its ``stage`` section
  and ``main``: staging is keyed by what it produces) and
  ``kernel_subset.cmake``;
* ``fi-jit``: ``fi-jit.tar.xz``, FlashInfer's JIT cache: the FlashInfer and
  tvm-ffi wheels staged in ``.device/whl`` and ``fi_prefill.py`` (which
  templates get compiled);
* ``pair-dsv3``, ``pair-kimi``: the serving suite's trained pairs
  (``serving_pairs.py pack``): the code that writes and trains them and the
  transformers they are trained with.

Each key also holds the device's torch (``VLLM_EAGLE3_DEVICE_TORCH``, default
the lent image's), the library every artifact is compiled or trained against.

The cache is ``$VLLM_EAGLE3_DEVICE_CACHE`` or ``~/.cache/vllm-eagle3/device``,
one directory per key holding the artifact and ``key.json``. ``kernels.py
stage`` and ``prepare.py`` lay the artifact whose key matches into
``.device/`` with ``<name>.key.json`` beside it, and say so; a cached or laid
artifact of other inputs is never used: the line names the inputs that
changed. On the device, ``check-laid`` removes a carried kernels build or
pair whose key file is not that of the tree it came with and the device's
torch (a tree changed after staging), and ``device_run.sh`` builds what is
not there; ``seal`` lists what
it made in ``artifacts.json`` (the key file it was carried with, the device's
torch, the sha256); ``put`` stores each after checking its digest and that its
inputs are the current ones.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))

from tools._common import StackError, run_main  # noqa: E402

TOOL = "device_cache"
# python3's torch on the lent machines (docs: the H100 and H200 images,
# 2026-11): what every artifact is compiled or trained against.
DEFAULT_DEVICE_TORCH = "2.11.0+cu130"
HARNESS = "tools/gpu_harness"
# kind -> (file name, directory under the repository root it is laid into)
ARTIFACTS = {
    "kernels": ("kernels-libs.tar.xz", ".device/kernels"),
    "fi-jit": ("fi-jit.tar.xz", ".device/fi-jit"),
    "pair-dsv3": ("pair-dsv3.tgz", ".device/pairs"),
    "pair-kimi": ("pair-kimi.tgz", ".device/pairs"),
}
FI_WHEELS = ("flashinfer_python", "apache_tvm_ffi")
PAIR_CODE = ("tests/e2e/gpu/serving_pairs.py", "tests/e2e/gpu/gpu_e2e_helpers.py", "tools/tiny_checkpoints.py",
             f"{HARNESS}/training.py", f"{HARNESS}/data.py", f"{HARNESS}/fp64_reference.py")
STAGE_SECTION = ("# --- stage (any machine)", "# --- build (the GPU machine)")


# --- the trees inputs are read from -------------------------------------------

class Tree:
    """A checkout's files (``git`` names a commit: its files as committed)."""

    def __init__(self, root: Path = REPO_ROOT, commit: str | None = None):
        self.root, self.commit = Path(root), commit

    def read(self, rel: str) -> bytes:
        if self.commit is None:
            path = self.root / rel
            if not path.is_file():
                raise StackError(f"{path} is missing")
            return path.read_bytes()
        r = subprocess.run(["git", "-C", str(self.root), "show", f"{self.commit}:{rel}"], capture_output=True)
        if r.returncode:
            raise StackError(f"{rel} at {self.commit}: {r.stderr.decode().strip()}")
        return r.stdout


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_path(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def device_torch() -> str:
    return os.environ.get("VLLM_EAGLE3_DEVICE_TORCH") or DEFAULT_DEVICE_TORCH


def build_recipe(text: str) -> str:
    """kernels.py as the build runs it: without the module docstring, the
    ``stage`` section and ``main`` (what ``stage`` writes is keyed by its own
    digests). Refuses a file whose section markers moved."""
    start, end = (text.find(m) for m in STAGE_SECTION)
    main = text.find("\ndef main(")
    doc = re.match(r'(?s)\s*(#[^\n]*\n\s*)*"""(.*?)"""\n', text)
    if min(start, end, main) < 0 or not start < end < main or doc is None:
        raise StackError(f"kernels.py: expected a docstring, then {STAGE_SECTION[0]!r} before "
                         f"{STAGE_SECTION[1]!r} before 'def main(': where did the build code move?")
    return text[doc.end():start] + text[end:main]


# --- inputs of each kind ------------------------------------------------------

def kernels_inputs(tree: Tree, sources: dict[str, str], torch: str) -> dict[str, str]:
    """``sources``: the staged archives' digests (sources.json, or the
    ``sources`` of a build's kernels.json)."""
    return {**{f"source {k}": v for k, v in sorted(sources.items())},
            "kernels.py (build side)": sha256(build_recipe(tree.read(f"{HARNESS}/kernels.py").decode()).encode()),
            "kernel_subset.cmake": sha256(tree.read(f"{HARNESS}/kernel_subset.cmake")),
            "device torch": torch}


def staged_sources(root: Path = REPO_ROOT) -> dict[str, str]:
    path = root / ".device" / "kernels" / "sources.json"
    if not path.is_file():
        raise StackError(f"{path} is missing: run `python3 tools/gpu_harness/kernels.py stage`")
    return json.loads(path.read_text())


def wheel_pins(tree: Tree) -> dict[str, str]:
    pins = {}
    for line in tree.read(f"{HARNESS}/wheels.txt").decode().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = (s.strip() for s in line.split("=="))
            pins[re.sub(r"[-_.]+", "_", name.lower())] = version
    return pins


def staged_wheel(whl_dir: Path, name: str, version: str) -> Path:
    found = sorted(whl_dir.glob(f"{name}-{version}-*.whl"))
    if len(found) != 1:
        raise StackError(f"{whl_dir} holds {len(found)} wheels of {name} {version}, not one: "
                         "run `python3 tools/gpu_harness/prepare.py`")
    return found[0]


def fi_jit_inputs(tree: Tree, whl_dir: Path, torch: str) -> dict[str, str]:
    pins = wheel_pins(tree)
    out = {}
    for name in FI_WHEELS:
        if name not in pins:
            raise StackError(f"{HARNESS}/wheels.txt pins no {name}")
        wheel = staged_wheel(whl_dir, name, pins[name])
        out[f"wheel {wheel.name}"] = sha256_path(wheel)
    out["fi_prefill.py"] = sha256(tree.read(f"{HARNESS}/fi_prefill.py"))
    out["device torch"] = torch
    return out


def pair_inputs(tree: Tree, pair: str, torch: str) -> dict[str, str]:
    return {"pair": pair, **{rel: sha256(tree.read(rel)) for rel in PAIR_CODE},
            "transformers": wheel_pins(tree).get("transformers", "not pinned"), "device torch": torch}


def inputs(kind: str, root: Path = REPO_ROOT, torch: str | None = None,
           sources: dict[str, str] | None = None) -> dict[str, str]:
    """The current inputs of ``kind`` in the checkout at ``root`` (its staged
    ``.device/`` included; ``sources``: the kernels' staged digests where
    they were just staged elsewhere)."""
    tree, torch = Tree(root), torch or device_torch()
    if kind == "kernels":
        return kernels_inputs(tree, sources if sources is not None else staged_sources(root), torch)
    if kind == "fi-jit":
        return fi_jit_inputs(tree, root / ".device" / "whl", torch)
    if kind in ARTIFACTS:
        return pair_inputs(tree, kind.removeprefix("pair-"), torch)
    raise StackError(f"no artifact kind {kind!r} (kinds: {', '.join(ARTIFACTS)})")


def make_key(kind: str, ins: dict[str, str]) -> str:
    return f"{kind}-{sha256(json.dumps(ins, sort_keys=True).encode())[:16]}"


def changed(old: dict[str, str], new: dict[str, str]) -> str:
    """``a changed (1234abcd -> 5678ef01), b changed ...``: what differs."""
    parts = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if a != b:
            short = (lambda v: "none" if v is None else v[:12] if re.fullmatch(r"[0-9a-f]{64}", v) else v)
            parts.append(f"{k} changed ({short(a)} -> {short(b)})")
    return ", ".join(parts) or "nothing changed"


# --- the cache ---------------------------------------------------------------

def cache_root() -> Path:
    if env := os.environ.get("VLLM_EAGLE3_DEVICE_CACHE"):
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "vllm-eagle3" / "device"


def entries(kind: str) -> list[dict]:
    """The cache's key.json records of ``kind``, newest first."""
    root = cache_root()
    recs = []
    for f in root.glob(f"{kind}-*/key.json") if root.is_dir() else []:
        rec = json.loads(f.read_text())
        if rec.get("kind") == kind:
            recs.append(rec)
    return sorted(recs, key=lambda r: r.get("stored", ""), reverse=True)


def store(kind: str, artifact: Path, ins: dict[str, str], origin: str) -> str:
    key = make_key(kind, ins)
    name = ARTIFACTS[kind][0]
    d = cache_root() / key
    tmp = cache_root() / f".{key}.part"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shutil.copyfile(artifact, tmp / name)
    rec = {"kind": kind, "key": key, "file": name, "sha256": sha256_path(tmp / name), "inputs": ins,
           "stored": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "from": origin}
    (tmp / "key.json").write_text(json.dumps(rec, indent=1) + "\n")
    shutil.rmtree(d, ignore_errors=True)
    tmp.rename(d)
    return key


def lay(kind: str, ins: dict[str, str], root: Path = REPO_ROOT, dest: Path | None = None) -> str:
    """Lay the cached artifact of these inputs into ``root/.device/...`` (or
    ``dest``), with its key file; remove a laid one of other inputs. Returns
    the line to print."""
    name, rel = ARTIFACTS[kind]
    if dest is not None:
        dest = Path(dest)
        rel = str(dest.relative_to(root)) if dest.is_relative_to(root) else str(dest)
    dest = root / rel
    dest.mkdir(parents=True, exist_ok=True)
    key = make_key(kind, ins)
    keyfile = dest / (name.split(".")[0] + ".key.json")
    laid, notes = dest / name, []
    if laid.exists():
        old = json.loads(keyfile.read_text()) if keyfile.is_file() else None
        if old and old.get("key") == key and old.get("sha256") == sha256_path(laid):
            return f"{rel}/{name} already holds {key}: inputs unchanged"
        laid.unlink()
        why = ("no key file says what it was made of" if not old else changed(old["inputs"], ins)
               if old.get("key") != key else "its sha256 is not its key file's")
        notes.append(f"removed the stale {rel}/{name}: {why}")
    hit = cache_root() / key / "key.json"
    rec = None
    if hit.is_file():
        rec = json.loads(hit.read_text())
        got = sha256_path(hit.parent / name)
        if got != rec["sha256"]:
            raise StackError(f"{hit.parent / name}: sha256 {got[:12]}, its key.json says {rec['sha256'][:12]}: "
                             f"delete {hit.parent} and build it again")
        shutil.copyfile(hit.parent / name, laid)
        line = f"cached {name} laid into {rel} ({key}, stored {rec['stored']}): inputs match"
    else:
        older = entries(kind)
        line = (f"no cached {name} for {key}; the newest cached one ({older[0]['key']}) is stale, not used: "
                f"{changed(older[0]['inputs'], ins)}" if older else f"no cached {name} for {key}")
        line += f"; the device makes it once, then `{HARNESS}/device_cache.py put DIR`"
    keyfile.write_text(json.dumps({"kind": kind, "key": key, "inputs": ins, "laid": rec is not None,
                                   "sha256": rec["sha256"] if rec else None}, indent=1) + "\n")
    return "; ".join(notes + [line])


# --- the device side, and back -----------------------------------------------

def check_laid(torch: str, root: Path = REPO_ROOT) -> list[str]:
    """On the device: each laid kernels build and pair checked against the
    inputs of the tree it travelled with and this device's torch; a stale one
    is removed (the device then makes it). FlashInfer's JIT cache is not
    checked here: its wheels travel unpacked (``.device/site``)."""
    lines = []
    for kind in ("kernels", "pair-dsv3", "pair-kimi"):
        name, rel = ARTIFACTS[kind]
        laid = root / rel / name
        if not laid.is_file():
            continue
        keyfile = root / rel / (name.split(".")[0] + ".key.json")
        old = json.loads(keyfile.read_text()) if keyfile.is_file() else None
        if old is None:
            why = "no key file says what it was made of"
        else:
            try:
                now = inputs(kind, root, torch=torch)
                why = None if old["inputs"] == now else changed(old["inputs"], now)
            except StackError as e:
                why = f"its inputs cannot be read here: {e}"
            if why is None and old.get("sha256") is None:
                why = "it was not laid from the cache (device_cache.py put, then stage again)"
            elif why is None and old["sha256"] != sha256_path(laid):
                why = "its sha256 is not its key file's"
        if why is None:
            lines.append(f"{rel}/{name}: {old['key']}, inputs match")
        else:
            laid.unlink()
            lines.append(f"{rel}/{name} not used (removed): {why}")
    return lines


def seal(out: Path, torch: str, files: list[Path], root: Path = REPO_ROOT) -> dict:
    """On the device: ``out/artifacts.json`` lists each made artifact with
    the key file it was carried with (its inputs as the host computed them),
    the device's torch in place of the expected one, and its sha256."""
    by_name = {name: (kind, rel) for kind, (name, rel) in ARTIFACTS.items()}
    manifest_path = out / "artifacts.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    for f in files:
        if f.name not in by_name:
            raise StackError(f"{f.name}: not a device artifact ({', '.join(by_name)})")
        kind, rel = by_name[f.name]
        keyfile = root / rel / (f.name.split(".")[0] + ".key.json")
        carried = json.loads(keyfile.read_text()) if keyfile.is_file() else None
        ins = dict(carried["inputs"], **{"device torch": torch}) if carried else None
        manifest[f.name] = {"kind": kind, "sha256": sha256_path(f), "inputs": ins,
                            "key": make_key(kind, ins) if ins else None}
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _kernels_json(artifact: Path) -> dict:
    import tarfile

    with tarfile.open(artifact) as t:
        return json.loads(t.extractfile("kernels.json").read())


def verify_kernels(artifact: Path, ins: dict[str, str]) -> None:
    """The build's own record of its sources must be the key's."""
    rec = _kernels_json(artifact).get("sources", {})
    built = {f"source {'vllm-src' if k == 'vllm-src' else v['from']}": v["sha256"] for k, v in rec.items()}
    want = {k: v for k, v in ins.items() if k.startswith("source ")}
    if built != want:
        raise StackError(f"{artifact.name}: its kernels.json records other sources than its key: "
                         f"{changed(want, built)}")


def put(d: Path, root: Path = REPO_ROOT) -> list[str]:
    """Store each artifact ``d/artifacts.json`` lists, after its sha256 and
    key check out and its inputs (but the device's torch) are the current
    ones. Refuses the rest, one line each."""
    mpath = d / "artifacts.json"
    if not mpath.is_file():
        raise StackError(f"{mpath} is missing: put takes the folder a device call returned "
                         "(device_run.sh writes artifacts.json there)")
    lines, refused = [], 0
    for name, rec in json.loads(mpath.read_text()).items():
        kind, f = rec["kind"], d / name
        try:
            if not f.is_file():
                raise StackError(f"{name} did not come back")
            if (got := sha256_path(f)) != rec["sha256"]:
                raise StackError(f"{name}: sha256 {got[:12]}, artifacts.json says {rec['sha256'][:12]}")
            if not rec.get("inputs"):
                raise StackError(f"{name} came with no key file: lay the inputs with kernels.py stage / "
                                 "prepare.py before the call")
            if make_key(kind, rec["inputs"]) != rec["key"]:
                raise StackError(f"{name}: its key {rec['key']} is not the digest of its inputs")
            now = inputs(kind, root, torch=rec["inputs"]["device torch"])
            if now != rec["inputs"]:
                raise StackError(f"{name} was made from inputs that are no longer current: "
                                 f"{changed(rec['inputs'], now)}")
            if kind == "kernels":
                verify_kernels(f, rec["inputs"])
            key = store(kind, f, rec["inputs"], f"device_cache.py put {d}")
            note = "" if rec["inputs"]["device torch"] == device_torch() else (
                f" (made on torch {rec['inputs']['device torch']}; the expected device torch is "
                f"{device_torch()}: set VLLM_EAGLE3_DEVICE_TORCH)")
            lines.append(f"stored {name} as {key}{note}")
        except StackError as e:
            refused += 1
            lines.append(f"refused {name}: {e}")
    if refused:
        raise StackError("\n".join(lines))
    return lines


def shared_digests(readme: Path) -> dict[str, str]:
    """``- NAME HEX`` lines of the shared folder's README."""
    return {m[1]: m[2] for m in re.finditer(r"(?m)^- (\S+)\s+([0-9a-f]{64})\s*$", readme.read_text())}


def import_shared(d: Path, commit: str, torch: str, root: Path = REPO_ROOT) -> list[str]:
    """The kernels and FlashInfer JIT cache of a folder made outside this
    tool (a README listing each file's sha256, the commit it was built at):
    their inputs are that commit's files, the kernels' sources its own
    kernels.json, the FlashInfer wheels the staged ones (the commit must pin
    the same versions)."""
    digests = shared_digests(d / "README.md") if (d / "README.md").is_file() else {}
    tree, lines = Tree(root, commit), []
    for kind, ins_of in (("kernels", lambda f: kernels_inputs(
            tree, {"vllm-src" if k == "vllm-src" else v["from"]: v["sha256"]
                   for k, v in _kernels_json(f)["sources"].items()}, torch)),
                         ("fi-jit", lambda f: fi_jit_inputs(tree, root / ".device" / "whl", torch))):
        name = ARTIFACTS[kind][0]
        f = d / name
        if not f.is_file():
            continue
        if name not in digests:
            raise StackError(f"{d / 'README.md'} lists no sha256 for {name}")
        if (got := sha256_path(f)) != digests[name]:
            raise StackError(f"{f}: sha256 {got[:12]}, {d / 'README.md'} says {digests[name][:12]}")
        if kind == "fi-jit" and wheel_pins(tree) != wheel_pins(Tree(root)):
            raise StackError(f"{HARNESS}/wheels.txt at {commit} pins other versions than the staged wheels")
        ins = ins_of(f)
        key = store(kind, f, ins, f"device_cache.py import-shared {d} --built-at {commit}")
        lines.append(f"stored {name} as {key}")
    if not lines:
        raise StackError(f"{d} holds neither {ARTIFACTS['kernels'][0]} nor {ARTIFACTS['fi-jit'][0]}")
    return lines


def main(argv: list[str] | None = None) -> int:
    head, _, rest = __doc__.partition("\n\n")
    ap = argparse.ArgumentParser(prog="device_cache.py", description=head, epilog=rest,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("key", help="each kind's key and inputs, from this checkout's staged .device/")
    k.add_argument("kinds", nargs="*", default=list(ARTIFACTS))
    p = sub.add_parser("put", help="store what a device call returned (the folder holding artifacts.json)")
    p.add_argument("dir", type=Path)
    i = sub.add_parser("import-shared", help="store artifacts made outside this tool, after their digests")
    i.add_argument("dir", type=Path)
    i.add_argument("--built-at", required=True, metavar="COMMIT", help="the commit they were built at")
    i.add_argument("--torch", required=True, help="the device torch they were built with")
    sub.add_parser("list", help="what the cache holds")
    c = sub.add_parser("check-laid", help="(device_run.sh, on the device) remove a stale carried artifact")
    c.add_argument("--torch", required=True)
    s = sub.add_parser("seal", help="(device_run.sh, on the device) list made artifacts in OUT/artifacts.json")
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--torch", required=True)
    s.add_argument("files", type=Path, nargs="+")
    a = ap.parse_args(argv)
    if a.cmd == "key":
        for kind in a.kinds:
            ins = inputs(kind)
            print(json.dumps({"kind": kind, "key": make_key(kind, ins), "inputs": ins}, indent=1))
    elif a.cmd == "put":
        for line in put(a.dir):
            print(f"[{TOOL}] {line}")
    elif a.cmd == "import-shared":
        for line in import_shared(a.dir, a.built_at, a.torch):
            print(f"[{TOOL}] {line}")
    elif a.cmd == "list":
        for kind in ARTIFACTS:
            for rec in entries(kind):
                print(f"{rec['key']}  {rec['stored']}  {rec['file']}  from {rec['from']}")
    elif a.cmd == "check-laid":
        for line in check_laid(a.torch):
            print(f"== {line}")
    else:
        seal(a.out, a.torch, a.files)
    return 0


if __name__ == "__main__":
    run_main(TOOL, main)
