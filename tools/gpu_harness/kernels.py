#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Build vLLM 0.16.0's own CUDA kernels, the subset DeepSeek-family EAGLE-3 serving reaches, from registry sources only.

    python3 tools/gpu_harness/kernels.py stage                  (any machine with pip's index)
    python3 tools/gpu_harness/kernels.py build --out DIR [-j N]  (the GPU machine, no network)

``stage`` writes into ``.device/kernels/`` the two source archives the build
needs, both package-registry artifacts pinned in pin.toml with their sha256
and verified by tools.fetch: the sdist's ``CMakeLists.txt``, ``cmake/`` and
``csrc/`` (from ``vllm-0.16.0.tar.gz``), and the ``nvidia-cutlass`` wheel,
whose ``cutlass_library/source`` holds CUTLASS's C++ headers and whose
``cutlass_library`` package is the generator vLLM's CMake runs for Machete's
kernel sources (at configure time, from ``${CUTLASS_DIR}/python``). It then
lays the ``kernels-libs.tar.xz`` built from them, when the device cache holds
one whose key matches (device_cache.py), so that the device skips the build.

``build`` verifies both again (the wheel against pin.toml, the sdist subset
against the digest stage recorded from the verified sdist), unpacks them, and
runs vLLM's own ``CMakeLists.txt`` (unmodified) the way its setup.py does for
sm_90a, with ``kernel_subset.cmake`` trimming the targets to ``SUBSET`` below.
CUTLASS comes in through vLLM's own ``VLLM_CUTLASS_SRC_DIR`` switch and the
include directories its targets read (``CUTLASS_INCLUDE_DIR``,
``CUTLASS_TOOLS_UTIL_INCLUDE_DIR``, and ``CUTLASS_DIR`` for the generator).
Nothing else is fetched: vLLM's flash-attention fork, FlashMLA and DeepGEMM
have no registry release at the versions v0.16.0 pins, so their source
directories hold no CMakeLists.txt and their targets are not built. Op
registrations come from the sdist's ``csrc/torch_bindings.cpp`` and
``csrc/moe/torch_bindings.cpp``: every schema stays, and each ``impl`` whose
C++ function the subset does not define is dropped (found with ``nm`` on the
first link). So vLLM sees the ops the full build has, and calling one that
was not built raises torch's "Could not run '_C::<op>' ... CUDA backend" by
name; nothing falls back to a stand-in. The libraries land in ``DIR/vllm/``,
laid out as in the wheel, with ``kernels.json`` (what was built, what was
not, timings).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from tools._common import StackError, load_pin, run_main, sha256_file  # noqa: E402

TOOL = "kernels"
STAGE_DIR = REPO_ROOT / ".device" / "kernels"
HOOK = Path(__file__).resolve().with_name("kernel_subset.cmake")
SDIST_MEMBERS = ("CMakeLists.txt", "cmake/", "csrc/")
# The pin.toml artifact whose wheel carries CUTLASS's headers, and the
# directories of it vLLM's targets include (CUTLASS_INCLUDE_DIR,
# CUTLASS_TOOLS_UTIL_INCLUDE_DIR).
CUTLASS_ARTIFACT = "nvidia-cutlass"
CUTLASS_PY = "cutlass_library/"
CUTLASS_TREE = CUTLASS_PY + "source/"
CUTLASS_DIRS = {"CUTLASS_INCLUDE_DIR": "include", "CUTLASS_TOOLS_UTIL_INCLUDE_DIR": "tools/util/include"}
# vLLM's CMake FetchContent sources with no registry release at the versions
# v0.16.0 pins: each gets a directory with no CMakeLists.txt (not_built_sources),
# so FetchContent adds no subproject and their targets are never built.
EMPTY_SOURCES = {"VLLM_FLASH_ATTN_SRC_DIR": "flash-attention", "FLASH_MLA_SRC_DIR": "flashmla",
                 "QUTLASS_SRC_DIR": "qutlass", "TRITON_KERNELS_SRC_DIR": "triton_kernels"}

# What each target keeps, with the reason it is reached. Paths are suffixes of
# the sources vLLM's CMakeLists.txt lists; the build stops if one is missing.
SUBSET: dict[str, list[str]] = {
    "_C": [
        "csrc/cache_kernels.cu",            # KV-cache writes (MLA, drafter), MLA context gather, DSA indexer cache
        "csrc/attention/merge_attn_states.cu",  # MLA prefill: context + new tokens
        "csrc/layernorm_kernels.cu",        # rms_norm, fused_add_rms_norm (CustomOp path)
        "csrc/activation_kernels.cu",       # silu_and_mul (MoE and dense MLP)
        "csrc/pos_encoding_kernels.cu",     # rotary_embedding (YaRN goes through it too)
        "csrc/cuda_view.cu",                # get_cuda_view_from_cpu_tensor
        "csrc/cuda_utils_kernels.cu",       # _C_cuda_utils device attributes
        "csrc/sampler.cu",                  # top_k_per_row_* (DSA indexer), repetition penalties
        "csrc/quantization/marlin/gptq_marlin_repack.cu",  # INT4 experts: gptq_marlin_moe_repack
        "csrc/quantization/w8a8/fp8/per_token_group_quant.cu",  # DSA indexer: q to fp8 (per_token_group_fp8_quant)
        # Evaluated at import (w8a8_utils, fp4 and sparse utils): the entries
        # answer capability queries; their CUTLASS kernels are not built.
        "csrc/quantization/w8a8/cutlass/scaled_mm_entry.cu",
        "csrc/quantization/fp4/nvfp4_scaled_mm_entry.cu",
        "csrc/sparse/cutlass/sparse_scaled_mm_entry.cu",
        "csrc/cutlass_extensions/common.cpp",
        "csrc/torch_bindings.cpp",
    ],
    "_moe_C": [
        "csrc/moe/moe_align_sum_kernels.cu",  # moe_align_block_size, moe_sum
        "csrc/moe/topk_softmax_kernels.cu",   # topk_softmax / topk_sigmoid routers
        "csrc/moe/grouped_topk_kernels.cu",   # DeepSeek-V3 / Kimi noaux_tc routing
        "csrc/moe/marlin_moe_wna16/ops.cu",   # moe_wna16_marlin_gemm (Kimi-K2.5 INT4 experts)
        # compressed-tensors W4A16 symmetric (uint4b8) with bf16 activations.
        "csrc/moe/marlin_moe_wna16/sm80_kernel_bfloat16_u4b8_bfloat16.cu",
        "csrc/moe/torch_bindings.cpp",
    ],
}
# Whose objects ninja starts first (kernel_subset.cmake's EAGLE3_KERNEL_FIRST):
# Marlin MoE's one instantiation file is the longest object (259-275 s on the
# H200, results/2026-12-02_h200_kernels_build_call50.json); _C's are about a
# minute each. Started last, as ninja otherwise does, it sets the wall time.
BUILD_FIRST = ["_moe_C"]
BINDINGS = {"_C": "csrc/torch_bindings.cpp", "_moe_C": "csrc/moe/torch_bindings.cpp"}
# kernel_selector.h (written by upstream's generate_kernels.py at configure
# time) names every Marlin MoE instantiation; the branches of the files not
# compiled are left out, so those variants reach upstream's own MarlinDefault
# error ("... is not supported") instead of an unresolved symbol at load.
MARLIN_SELECTOR = "csrc/moe/marlin_moe_wna16/kernel_selector.h"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --- registrations -----------------------------------------------------------

_STMT = re.compile(r"\b(\w+)\.(def|impl)\(")


def _statement_end(text: str, start: int) -> int:
    """Index after the ';' closing the call that opens at ``start``, skipping
    string literals and comments (schemas hold parentheses)."""
    depth, i, n = 0, start, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            i += 1
            while text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif text.startswith("//", i):
            i = text.index("\n", i)
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == ";" and depth == 0:
            return i + 1
        i += 1
    raise StackError(f"unterminated registration at offset {start}")


def registrations(text: str) -> list[tuple[int, int, str, str, str | None]]:
    """(start, end, kind, op, C++ function or None) of each def/impl call."""
    out = []
    for m in _STMT.finditer(text):
        end = _statement_end(text, m.end() - 1)
        call = text[m.start():end]
        op = re.search(r'"(\w+)', call)
        bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', call)
        fn = re.search(r"&\s*([\w:]+)", bare)
        out.append((m.start(), end, m.group(2), op.group(1) if op else "", fn.group(1) if fn else None))
    return out


def referenced_functions(text: str) -> set[str]:
    return {fn for *_, fn in registrations(text) if fn}


def filter_bindings(text: str, missing: set[str]) -> tuple[str, list[str]]:
    """Upstream's bindings minus the calls that name a function in ``missing``:
    an ``impl`` goes (its schema stays), a ``def`` that binds the function
    itself goes whole. Returns the text and the ops left without a kernel."""
    dropped, pieces, pos = [], [], 0
    for start, end, kind, op, fn in registrations(text):
        if fn in missing:
            pieces.append(text[pos:start])
            pieces.append(f"/* eagle3 kernel subset: {fn} not built */")
            pos = end
            dropped.append(op)
    pieces.append(text[pos:])
    return "".join(pieces), sorted(set(dropped))


def undefined_functions(lib: Path) -> set[str]:
    """Function names the linked library leaves undefined (demangled, no args)."""
    out = subprocess.run(["nm", "-C", "-u", "-D", str(lib)], capture_output=True, text=True, check=True).stdout
    return {line.split(None, 1)[-1].split("(")[0].strip() for line in out.splitlines() if "(" in line}


def trim_marlin_selector(text: str, kept_files: list[str]) -> str:
    types = []
    for f in kept_files:
        m = re.search(r"sm\d+_kernel_(\w+?)_(\w+?)_(\w+?)\.cu$", f)
        if m:
            types.append(tuple(m.groups()))
    lines = text.splitlines(keepends=True)
    head = [ln for ln in lines if ln.startswith("//")]
    body = [ln for ln in lines if not ln.startswith("//")]
    kept = []
    for cond, action in zip(body[0::2], body[1::2]):
        t = re.findall(r"[abc]_type == vllm::k(\w+)", cond)
        if len(t) >= 3 and tuple(x.lower() for x in t[:3]) in types:
            kept.append((cond, action))
    if not kept:
        raise StackError(f"{MARLIN_SELECTOR}: no branch for {types}; did generate_kernels.py change?")
    out = []
    for i, (cond, action) in enumerate(kept):
        cond = re.sub(r"^(else )?if", "if" if i == 0 else "else if", cond)
        out += [cond, action]
    return "".join(head + out)


# --- stage (any machine) -----------------------------------------------------

def _sdist_subset() -> bytes:
    from tools.fetch import ensure, offline_default

    sdist = ensure(load_pin().artifact("sdist"), offline=offline_default())
    buf = io.BytesIO()
    with tarfile.open(sdist) as src, tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as dst:
        for m in src.getmembers():
            rel = m.name.split("/", 1)[1] if "/" in m.name else ""
            if m.isfile() and rel.startswith(SDIST_MEMBERS):
                m.name = rel
                m.uid = m.gid = 0
                m.uname = m.gname = ""
                dst.addfile(m, src.extractfile(m))
    return buf.getvalue()


def stage(args: argparse.Namespace) -> int:
    from tools.fetch import ensure, offline_default

    STAGE_DIR.mkdir(parents=True, exist_ok=True)
    for old in STAGE_DIR.iterdir():  # archives of an earlier layout must not travel
        if old.is_file() and old.suffix in (".xz", ".whl", ".json"):
            old.unlink()
    sd = _sdist_subset()
    (STAGE_DIR / "vllm-src.tar.xz").write_bytes(_xz(sd))
    art = load_pin().artifact(CUTLASS_ARTIFACT)
    shutil.copy(ensure(art, offline=offline_default()), STAGE_DIR / art.filename)
    manifest = {"vllm-src": sha256_bytes(sd), art.filename: art.sha256}
    (STAGE_DIR / "sources.json").write_text(json.dumps(manifest, indent=1) + "\n")
    size = sum(p.stat().st_size for p in STAGE_DIR.iterdir() if p.is_file())
    print(f"[{TOOL}] staged {len(manifest)} archives in {STAGE_DIR} ({size / 2**20:.1f} MiB); "
          f"carry '.device/kernels'")
    # The built libraries of these sources, when the device cache has them
    # (device_cache.py): the device then skips the build.
    from tools.gpu_harness import device_cache

    ins = device_cache.inputs("kernels", REPO_ROOT, sources=manifest)
    print(f"[{TOOL}] {device_cache.lay('kernels', ins, REPO_ROOT, dest=STAGE_DIR)}")
    return 0


def _xz(data: bytes) -> bytes:
    import lzma

    return lzma.compress(data, preset=6)


# --- build (the GPU machine) -------------------------------------------------

def _missing(path: Path) -> StackError:
    return StackError(f"{path} is missing: run `python3 tools/gpu_harness/kernels.py stage` "
                      "and carry .device/kernels")


def _unpack_sdist(dest: Path, staged: Path = STAGE_DIR) -> str:
    """The sdist subset, checked against the digest ``stage`` recorded from
    the verified sdist; returns that digest."""
    import lzma

    path, manifest = staged / "vllm-src.tar.xz", staged / "sources.json"
    if not path.is_file() or not manifest.is_file():
        raise _missing(path)
    want = json.loads(manifest.read_text()).get("vllm-src")
    tar = lzma.decompress(path.read_bytes())
    if sha256_bytes(tar) != want:
        raise StackError(f"{path}: sha256 {sha256_bytes(tar)} != {want} (sources.json)")
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
        tf.extractall(dest, filter="data")
    return want


def unpack_cutlass(dest: Path, staged: Path = STAGE_DIR) -> dict[str, Path]:
    """CUTLASS's headers out of the pinned nvidia-cutlass wheel, after its
    sha256 matches pin.toml; returns {CMake variable: directory}."""
    import zipfile

    art = load_pin().artifact(CUTLASS_ARTIFACT)
    wheel = staged / art.filename
    if not wheel.is_file():
        raise _missing(wheel)
    if (got := sha256_file(wheel)) != art.sha256:
        raise StackError(f"{wheel}: sha256 {got}, pin.toml [artifacts.{CUTLASS_ARTIFACT}] says {art.sha256}")
    prefixes = tuple(CUTLASS_TREE + d + "/" for d in CUTLASS_DIRS.values())
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.startswith(prefixes) and not n.endswith("/")]
        if not names:
            raise StackError(f"{wheel} has no {CUTLASS_TREE}include/: not CUTLASS's header wheel")
        for n in names:
            target = dest / n[len(CUTLASS_TREE):]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(z.read(n))
        # CMakeLists.txt runs csrc/quantization/machete/generate.py with
        # ${CUTLASS_DIR}/python on PYTHONPATH, as in CUTLASS's source tree;
        # the wheel's cutlass_library package sits there.
        for n in z.namelist():
            if n.startswith(CUTLASS_PY) and not n.startswith(CUTLASS_TREE) and n.endswith(".py"):
                target = dest / "python" / n
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(z.read(n))
    return {var: dest / d for var, d in CUTLASS_DIRS.items()}


def cutlass_defines(root: Path, dirs: dict[str, Path]) -> list[str]:
    """CMake definitions for the unpacked wheel: the include directories vLLM's
    targets read, and CUTLASS_DIR, whose ``python/`` the Machete generator
    imports cutlass_library from (CMakeLists.txt sets it nowhere itself)."""
    return [*(f"-D{var}={d}" for var, d in dirs.items()), f"-DCUTLASS_DIR={root}"]


def not_built_sources(work: Path) -> dict[str, str]:
    """A directory for each of EMPTY_SOURCES, holding one file and no
    CMakeLists.txt: FetchContent refuses an empty SOURCE_DIR, and adds no
    subproject for this one. FlashMLA's CMake reads one Python file, which gets
    an empty stand-in. Returns the environment that points vLLM's CMake there."""
    env = {}
    for var, name in EMPTY_SOURCES.items():
        (work / name).mkdir(parents=True)
        (work / name / "NOT_BUILT").write_text("no registry release at the version vLLM 0.16.0 pins\n")
        env[var] = str(work / name)
    (work / "flashmla" / "flash_mla").mkdir()
    (work / "flashmla" / "flash_mla" / "flash_mla_interface.py").write_text("import torch\n")
    return env


def _run(cmd: list[str], log: Path, **kw) -> float:
    t = time.monotonic()
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, **kw)
    if r.returncode:
        tail = log.read_text().splitlines()[-30:]
        raise StackError(f"{cmd[0]} failed (rc {r.returncode}); last lines of {log}:\n" + "\n".join(tail))
    return round(time.monotonic() - t, 1)


_IMPORT_CHECK = """
import importlib.util, sys, torch
name, path = sys.argv[1:]
spec = importlib.util.spec_from_file_location(name, path)
spec.loader.exec_module(importlib.util.module_from_spec(spec))
ops = [o for o in torch._C._dispatch_get_all_op_names() if o.startswith(name + "::")]
assert ops, f"{path} imported but registered no {name}:: op"
print(f"imported {name}: {len(ops)} ops")
"""


def build(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "kernels-build.log"
    log.write_text("")
    vsrc = work / "vllm"
    sdist_digest = _unpack_sdist(vsrc)
    cutlass = unpack_cutlass(work / "cutlass")
    empty = not_built_sources(work)
    placeholder = work / "placeholder.cpp"
    placeholder.write_text("// targets outside the subset are never built\n")
    swaps = {}
    for tgt, rel in BINDINGS.items():
        sub = vsrc / rel.replace(".cpp", "_subset.cpp")
        shutil.copy(vsrc / rel, sub)
        swaps[tgt] = f"{rel}={sub}"

    env = dict(os.environ, TORCH_CUDA_ARCH_LIST="9.0", VLLM_CUTLASS_SRC_DIR=str(work / "cutlass"), **empty)
    py = sys.executable
    pypath = subprocess.run([py, "-c", "import sys; print(':'.join(sys.path))"],
                            capture_output=True, text=True, check=True).stdout.strip()
    bdir = work / "build"
    cmake = ["cmake", "-S", str(vsrc), "-B", str(bdir), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
             "-DVLLM_TARGET_DEVICE=cuda", f"-DVLLM_PYTHON_EXECUTABLE={py}", f"-DVLLM_PYTHON_PATH={pypath}",
             f"-DFETCHCONTENT_BASE_DIR={work / 'fc'}", "-DNVCC_THREADS=1",
             *cutlass_defines(work / "cutlass", cutlass),
             f"-DCMAKE_PROJECT_INCLUDE={HOOK}", f"-DEAGLE3_KERNEL_TARGETS={';'.join(SUBSET)}",
             f"-DEAGLE3_KERNEL_PLACEHOLDER={placeholder}",
             f"-DEAGLE3_KERNEL_FIRST={';'.join(BUILD_FIRST)}"]
    cmake += [f"-DEAGLE3_KERNEL_SRCS_{t}={';'.join(s)}" for t, s in SUBSET.items()]
    cmake += [f"-DEAGLE3_KERNEL_SWAP_{t}={s}" for t, s in swaps.items()]
    timings = {"configure_s": _run(cmake, log, env=env)}
    sel = vsrc / MARLIN_SELECTOR
    sel.write_text(trim_marlin_selector(sel.read_text(), SUBSET["_moe_C"]))

    ninja = ["ninja", "-C", str(bdir), f"-j{args.jobs}",
             *(f"eagle3_first_{t}" if t in BUILD_FIRST else t for t in SUBSET)]
    timings["compile_s"] = _run(ninja, log, env=env)
    libs = {t: next(bdir.rglob(f"{t}.*.so")) for t in SUBSET}
    not_built = {}
    for tgt, rel in BINDINGS.items():
        text = (vsrc / rel).read_text()
        missing = referenced_functions(text) & undefined_functions(libs[tgt])
        filtered, not_built[tgt] = filter_bindings(text, missing)
        Path(swaps[tgt].split("=", 1)[1]).write_text(filtered)
    timings["relink_s"] = _run(ninja, log, env=env)
    for tgt, rel in BINDINGS.items():
        left = referenced_functions((vsrc / rel).read_text()) & undefined_functions(libs[tgt])
        if left:
            raise StackError(f"{tgt} still leaves {sorted(left)} undefined")
    # Imported as vLLM imports it, each in a fresh interpreter (side by side:
    # each starts torch): an unresolved symbol shows here, by name.
    t_import = time.monotonic()
    checks = {tgt: subprocess.Popen([py, "-c", _IMPORT_CHECK, tgt, str(lib)], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True) for tgt, lib in libs.items()}
    for tgt, proc in checks.items():
        text = proc.communicate()[0]
        with log.open("a") as f:
            f.write(text)
        if proc.returncode:
            raise StackError(f"{libs[tgt]} does not import:\n{text[-3000:]}")
    timings["import_check_s"] = round(time.monotonic() - t_import, 1)
    for tgt, lib in libs.items():
        dest = out / "vllm" / lib.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(lib, dest)
    timings["total_s"] = round(time.monotonic() - t0, 1)
    steps = [ln.split("\t") for ln in (bdir / ".ninja_log").read_text().splitlines()[1:]]
    timings["slowest_objects_s"] = dict(sorted(
        ((st[3].rsplit("/", 1)[-1], round((int(st[1]) - int(st[0])) / 1000)) for st in steps if len(st) >= 4),
        key=lambda kv: -kv[1])[:6])
    timings["compile_steps"] = len(steps)
    art = load_pin().artifact(CUTLASS_ARTIFACT)
    report = {
        "targets": {t: {"library": f"vllm/{libs[t].name}", "bytes": libs[t].stat().st_size,
                        "sources": SUBSET[t]} for t in SUBSET},
        "schemas_without_kernel": not_built,
        "not_built": {var: f"{name}: no registry release at the version v0.16.0 pins"
                      for var, name in EMPTY_SOURCES.items()},
        "sources": {"vllm-src": {"from": load_pin().artifact("sdist").filename, "sha256": sdist_digest},
                    CUTLASS_ARTIFACT: {"from": art.filename, "sha256": art.sha256}},
        "timings": timings, "jobs": args.jobs,
        "nvcc": subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1],
    }
    (out / "kernels.json").write_text(json.dumps(report, indent=1) + "\n")
    # One archive, small enough to come back from the device and to be
    # carried by later calls instead of rebuilding.
    with tarfile.open(out / "kernels-libs.tar.xz", "w:xz", preset=3) as tf:
        tf.add(out / "kernels.json", "kernels.json")
        tf.add(out / "vllm", "vllm")
    print(json.dumps({k: report[k] for k in ("timings", "schemas_without_kernel")}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    head, _, rest = __doc__.partition("\n\n")
    ap = argparse.ArgumentParser(prog="kernels.py", description=head, epilog=rest,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("stage", help="write the verified source archives into .device/kernels")
    b = sub.add_parser("build", help="build the subset (needs nvcc, cmake, ninja, torch with CUDA)")
    b.add_argument("--out", required=True, help="where vllm/... and kernels.json go")
    b.add_argument("--work", default="/tmp/eagle3-kernels", help="scratch directory (emptied)")
    b.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 8)
    args = ap.parse_args(argv)
    return stage(args) if args.cmd == "stage" else build(args)


if __name__ == "__main__":
    run_main(TOOL, main)
