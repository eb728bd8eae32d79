#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Build vLLM 0.16.0's own CUDA kernels, the subset DeepSeek-family EAGLE-3 serving reaches, with no network.

    python3 tools/gpu_harness/kernels.py stage --cutlass-git DIR --flash-attn-git DIR \
        --deepgemm-git DIR --fmt-git DIR                                               (any machine)
    python3 tools/gpu_harness/kernels.py build --out DIR [-j N]                          (the GPU machine)

``stage`` writes into ``.device/kernels/`` the source archives the build
needs, each checked against pin.toml before it is written: the pinned sdist's
``CMakeLists.txt``, ``cmake/`` and ``csrc/`` (the sdist itself is verified by
tools.fetch), and ``git archive`` of CUTLASS, flash-attention, the CUTLASS
commit flash-attention's ``csrc/cutlass`` submodule names, DeepGEMM and its
fmt submodule (``[kernel_sources.*]``: repository, commit, paths, sha256 of
the tar). DeepGEMM's submodule commits are checked against those pins too.

``build`` verifies the archives again, unpacks them, and runs vLLM's own
``CMakeLists.txt`` (unmodified) the way its setup.py does for sm_90a, with
``kernel_subset.cmake`` trimming the targets to ``SUBSET`` below. Op
registrations come from the sdist's ``csrc/torch_bindings.cpp`` and
``csrc/moe/torch_bindings.cpp``: every schema stays, and each ``impl`` whose
C++ function the subset does not define is dropped (found with ``nm`` on the
first link). So vLLM sees the ops the full build has, and calling one that was
not built raises torch's "Could not run '_C::<op>' ... CUDA backend" by name;
nothing falls back to a stand-in. The libraries land in ``DIR/vllm/``, laid
out as in the wheel, with ``kernels.json`` (what was built, what was not,
timings). DeepGEMM is built beside them, by its own ``setup.py``, into
``DIR/deep_gemm/``.
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
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from tools._common import StackError, load_pin, run_main  # noqa: E402

TOOL = "kernels"
STAGE_DIR = REPO_ROOT / ".device" / "kernels"
HOOK = Path(__file__).resolve().with_name("kernel_subset.cmake")
SDIST_MEMBERS = ("CMakeLists.txt", "cmake/", "csrc/")

FA3_VARIANTS = ("_paged_split", "_split", "_paged", "")
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
    "_vllm_fa3_C": [
        # 64_512: FLASH_ATTN_MLA decode and verify (q_v); 192_128: MLA prefill;
        # 128: the Llama drafters' heads (SpecForge's and TorchSpec's published
        # configs: 7168 / 56); 192: a DeepSeek target with MLA off
        # (VLLM_MLA_DISABLE=1) on FLASH_ATTN, whose value heads vLLM pads to
        # 192 (H200 call 32 reached it, split and paged, when MLA was off).
        # Each paged or not, split or not: FLASH_ATTN_MLA passes num_splits > 1
        # when it captures full CUDA graphs (H200 call 19: "This flash attention
        # build does not support splits" without the split files), and FA3
        # reads a paged KV cache through TMA, with the non-paged kernel, when
        # the page size is a multiple of its tile. Longest first (H200 call 23:
        # 128 split 192 s ... 192_128 110 s): ninja starts them in this order.
        *(f"hopper/instantiations/flash_fwd_hdim{h}_bf16{v}_sm90.cu"
          for h in ("128", "64_512", "192", "192_128") for v in FA3_VARIANTS),
        "hopper/flash_fwd_combine.cu", "hopper/flash_prepare_scheduler.cu",
        "hopper/flash_api.cpp", "hopper/flash_api_torch_lib.cpp",  # the ops and PyInit__vllm_fa3_C
    ],
}
# flash-attention's own switches for what the instantiations above leave out.
# PackGQA without splits is a speed choice of the heuristic (split kernels
# always pack), so leaving it out changes which tile runs, never a result.
# LOCAL is sliding-window attention, which none of these models has; each
# instantiation then compiles two mask variants (causal, none) instead of
# three, and a sliding-window call fails by name in flash_api.cpp
# ("This flash attention build does not support local attention.").
FA3_DEFS = ["FLASHATTENTION_DISABLE_FP16", "FLASHATTENTION_DISABLE_FP8",
            "FLASHATTENTION_DISABLE_HDIM96", "FLASHATTENTION_DISABLE_HDIM256",
            "FLASHATTENTION_DISABLE_PACKGQA", "FLASHATTENTION_DISABLE_LOCAL"]
# flash_api.cpp's dispatch also names, under the same switches, the HDIM64
# instantiations for a head dim of 64 (value dim 64, or 65-256: 64_256). No
# model or drafter here has those shapes (MLA's value dim is 512, the published
# drafters' heads are 128 wide; the GPU suite's tiny drafters have 128 under the
# production profile for this reason), and the 8 files took 1,226 of the 5,024
# CPU-s of H200 call 23. Each such specialisation is instead defined in one
# generated file that raises, by shape, when called; the declarations are read
# from upstream's own instantiation files, so they are exactly the symbols
# those files define. (Call 32 stubbed the 192 files this way, and its MLA-off
# target stopped there with that error, by name.)
FA3_NOT_BUILT = [f"hopper/instantiations/flash_fwd_hdim{h}_bf16{v}_sm90.cu"
                 for h in ("64", "64_256") for v in FA3_VARIANTS]
FA3_STUB = "hopper/eagle3_fa3_not_built.cpp"
# Whose objects ninja starts first (kernel_subset.cmake's EAGLE3_KERNEL_FIRST):
# Marlin MoE's one instantiation file is the longest object (259-275 s on the
# H200, calls 23 and 31), then the FA3 files (110-207 s); _C's are about a
# minute each. Started last, as ninja otherwise does, the long ones set the wall
# time (363 s of compile in call 23 against about 250 s of work per core).
BUILD_FIRST = ["_moe_C", "_vllm_fa3_C"]
BINDINGS = {"_C": "csrc/torch_bindings.cpp", "_moe_C": "csrc/moe/torch_bindings.cpp"}
LIB_PATHS = {"_C": "vllm", "_moe_C": "vllm", "_vllm_fa3_C": "vllm/vllm_flash_attn"}
# kernel_selector.h (written by upstream's generate_kernels.py at configure
# time) names every Marlin MoE instantiation; the branches of the files not
# compiled are left out, so those variants reach upstream's own MarlinDefault
# error ("... is not supported") instead of an unresolved symbol at load.
MARLIN_SELECTOR = "csrc/moe/marlin_moe_wna16/kernel_selector.h"
# DeepGEMM (the DSA indexer's logits). v0.16.0's tools/install_deepgemm.sh
# runs its setup.py (bdist_wheel); ``build`` runs the same build_py (which
# copies the cute/cutlass headers its runtime JIT compiles against into the
# package) and build_ext, with each submodule unpacked from its pinned archive.
DEEPGEMM_SUBMODULES = {"third-party/cutlass": "cutlass", "third-party/fmt": "fmt"}
# The H200 image puts /opt/gcc/bin first on PATH. Its g++ wrapper built a
# deep_gemm._C that crashes in _C.init at import (H200 calls 46-47); the
# distribution's /usr/bin/g++-13 built one that imports and passes DeepGEMM's
# own tests/test_attention.py (call 49), so that is the default here.
# vLLM's CMake build is unaffected.
DEEPGEMM_CXX = "/usr/bin/g++-13"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def kernel_sources() -> dict[str, dict]:
    import tomllib

    data = tomllib.loads(load_pin().path.read_text())
    srcs = data.get("kernel_sources")
    if not srcs:
        raise StackError(f"{load_pin().path} has no [kernel_sources.*] tables")
    return srcs


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


_INSTANTIATION = re.compile(
    r"#ifndef (FLASHATTENTION_DISABLE_\w+)\s*\n\s*template void (run_mha_fwd_<([^>]*)>)\((.*?)\);\s*\n\s*#endif")


def fa3_stub_source(files: dict[str, str]) -> str:
    """The C++ of FA3_STUB: for each {path: text} of an upstream instantiation
    file, an explicit specialisation of the one ``run_mha_fwd_`` it
    instantiates, guarded by the same switch, that raises naming the shape."""
    out = ["// Generated by tools/gpu_harness/kernels.py: FA3 instantiations that",
           "// flash_api.cpp names but this kernel subset does not compile.",
           "#include <c10/util/Exception.h>", "#include <cutlass/numeric_types.h>", '#include "flash.h"', ""]
    for path, text in files.items():
        found = _INSTANTIATION.findall(text)
        if len(found) != 1:
            raise StackError(f"{path}: expected one guarded run_mha_fwd_ instantiation, found {len(found)}; "
                             "did flash-attention's generate_kernels.py change?")
        guard, name, args, params = found[0]
        arch, dtype, hdim, hdimv, split, paged, softcap, packgqa = (a.strip() for a in args.split(","))
        msg = (f"FlashAttention-3 head dim {hdim} / value dim {hdimv} ({dtype}, split={split}, "
               f"paged={paged}, softcap={softcap}, pack_gqa={packgqa}) is not in this kernel build; "
               f"add {Path(path).name} to SUBSET in tools/gpu_harness/kernels.py and rebuild")
        out += [f"#ifndef {guard}", f"template <> void {name}({params}) {{",
                f'  TORCH_CHECK(false, "{msg}");', "}", "#endif", ""]
    return "\n".join(out)


# --- stage (any machine) -----------------------------------------------------

def _git_archive(repo: Path, spec: dict) -> bytes:
    if not (repo / "HEAD").exists() and not (repo / ".git").exists():
        raise StackError(f"{repo} is not a git repository")
    have = subprocess.run(["git", "-C", str(repo), "cat-file", "-t", spec["commit"]],
                          capture_output=True, text=True)
    if have.stdout.strip() != "commit":
        raise StackError(f"{repo} lacks commit {spec['commit']} ({spec['repository']}); "
                         f"fetch it: git -C {repo} fetch {spec['repository']} {spec['commit']}")
    return subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", spec["commit"], "--", *spec["paths"]],
                          capture_output=True, check=True).stdout


def check_gitlinks(ls_tree: str, srcs: dict[str, dict]) -> None:
    """``git ls-tree`` of DeepGEMM's pinned commit: each submodule it records
    must be the commit pinned for the archive that stands in for it."""
    found = {}
    for line in ls_tree.splitlines():
        meta, _, path = line.partition("\t")
        _mode, kind, sha = meta.split()
        if kind == "commit":
            found[path] = sha
    for path, key in DEEPGEMM_SUBMODULES.items():
        want = srcs[key]["commit"]
        if found.get(path) != want:
            raise StackError(f"DeepGEMM {srcs['deepgemm']['commit']} records {path} at {found.get(path)}, "
                             f"pin.toml [kernel_sources.{key}] is {want}: pin the commit DeepGEMM records")


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
    srcs = kernel_sources()
    repos = {"cutlass": args.cutlass_git, "flash-attention": args.flash_attn_git,
             "flash-attention-cutlass": args.cutlass_git, "deepgemm": args.deepgemm_git, "fmt": args.fmt_git}
    STAGE_DIR.mkdir(parents=True, exist_ok=True)
    manifest = {}
    for key, spec in srcs.items():
        if repos.get(key) is None:
            raise StackError(f"no git repository given for [kernel_sources.{key}] ({spec['repository']})")
        tar = _git_archive(Path(repos[key]), spec)
        digest = sha256_bytes(tar)
        if digest != spec["sha256"]:
            raise StackError(f"git archive of {spec['repository']} {spec['commit']} has sha256 {digest}, "
                             f"pin.toml [kernel_sources.{key}] says {spec['sha256']}")
        if key == "deepgemm":
            check_gitlinks(subprocess.run(
                ["git", "-C", str(repos[key]), "ls-tree", spec["commit"], "--", *DEEPGEMM_SUBMODULES],
                capture_output=True, text=True, check=True).stdout, srcs)
        (STAGE_DIR / f"{key}.tar.xz").write_bytes(_xz(tar))
        manifest[key] = digest
    sd = _sdist_subset()
    (STAGE_DIR / "vllm-src.tar.xz").write_bytes(_xz(sd))
    manifest["vllm-src"] = sha256_bytes(sd)
    (STAGE_DIR / "sources.json").write_text(json.dumps(manifest, indent=1) + "\n")
    size = sum(p.stat().st_size for p in STAGE_DIR.glob("*.tar.xz"))
    print(f"[{TOOL}] staged {len(manifest)} archives in {STAGE_DIR} ({size / 2**20:.1f} MiB); "
          f"carry '.device/kernels'")
    return 0


def _xz(data: bytes) -> bytes:
    import lzma

    return lzma.compress(data, preset=6)


# --- build (the GPU machine) -------------------------------------------------

def _unpack(name: str, want: str, dest: Path) -> None:
    import lzma

    path = STAGE_DIR / f"{name}.tar.xz"
    if not path.is_file():
        raise StackError(f"{path} is missing: run `python3 tools/gpu_harness/kernels.py stage` "
                         "and carry .device/kernels")
    tar = lzma.decompress(path.read_bytes())
    if sha256_bytes(tar) != want:
        raise StackError(f"{path}: sha256 {sha256_bytes(tar)} != {want} (pin.toml / sources.json)")
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
        tf.extractall(dest, filter="data")


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


def _start_deepgemm(work: Path, srcs: dict[str, dict], cxx: str, log: Path):
    if not Path(cxx).is_file():
        raise StackError(f"--deepgemm-cxx {cxx} does not exist: name the distribution's C++ compiler "
                         "(see DEEPGEMM_CXX in kernels.py for why not the first g++ on PATH)")
    dg = work / "deepgemm"
    _unpack("deepgemm", srcs["deepgemm"]["sha256"], dg)
    for path, key in DEEPGEMM_SUBMODULES.items():
        _unpack(key, srcs[key]["sha256"], dg / path)
    env = dict(os.environ, DG_USE_LOCAL_VERSION="0", CC=cxx, CXX=cxx, LDSHARED=f"{cxx} -shared")
    f = log.open("w")
    f.write(f"$ CC={cxx} CXX={cxx} python3 setup.py build  (in {dg})\n")
    f.flush()
    proc = subprocess.Popen([sys.executable, "setup.py", "build"], cwd=dg, env=env, stdout=f,
                            stderr=subprocess.STDOUT)
    # Its own wall time, though it is collected only after ninja is done.
    done = {"start": time.monotonic()}
    waiter = threading.Thread(target=lambda: (proc.wait(), done.update(end=time.monotonic())), daemon=True)
    waiter.start()
    return dg, proc, waiter, done


def _finish_deepgemm(dg: Path, proc: subprocess.Popen, waiter: threading.Thread, done: dict, log: Path, out: Path,
                     cxx: str) -> dict:
    waiter.join()
    if proc.returncode:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise StackError(f"DeepGEMM's setup.py build failed (rc {proc.returncode}); last lines of {log}:\n{tail}")
    dest = out / "deep_gemm"
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(next((dg / "build").glob("lib*/deep_gemm")), dest)
    lib = next(dest.glob("_C*.so"))
    # setup.py compiles with sysconfig's -g: 19 MB, over what one file back
    # from the device may be. Only the debug sections go.
    _run(["strip", "--strip-debug", str(lib)], log)
    check = subprocess.run([sys.executable, "-c", "import deep_gemm; print('imported', deep_gemm.__file__, "
                            "'SMs', deep_gemm.get_num_sms())"], cwd=out, env=dict(os.environ, PYTHONPATH=str(out)),
                           capture_output=True, text=True)
    with log.open("a") as f:
        f.write(check.stdout + check.stderr)
    if check.returncode:
        raise StackError(f"{dest} does not import (rc {check.returncode}):\n{(check.stdout + check.stderr)[-2000:]}\n"
                         "Built with the H200 image's /opt/gcc wrapper, it crashed in _C.init (call 47); "
                         "--deepgemm-cxx names another compiler")
    return {"package": "deep_gemm", "library": f"deep_gemm/{lib.name}", "bytes": lib.stat().st_size,
            "compiler": cxx, "build_s": round(done["end"] - done["start"], 1)}


def build(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    srcs = kernel_sources()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "kernels-build.log"
    log.write_text("")
    vsrc = work / "vllm"
    staged = json.loads((STAGE_DIR / "sources.json").read_text()) if (STAGE_DIR / "sources.json").is_file() else {}
    _unpack("vllm-src", staged.get("vllm-src", ""), vsrc)
    _unpack("cutlass", srcs["cutlass"]["sha256"], work / "cutlass")
    _unpack("flash-attention", srcs["flash-attention"]["sha256"], work / "fa")
    _unpack("flash-attention-cutlass", srcs["flash-attention-cutlass"]["sha256"], work / "fa" / "csrc" / "cutlass")
    # FlashMLA's pinned commit is not obtainable (README, docs/gpu.md): its
    # CMake reads one Python file, and its target is never built here.
    (work / "flashmla" / "flash_mla").mkdir(parents=True)
    (work / "flashmla" / "flash_mla" / "flash_mla_interface.py").write_text("import torch\n")
    for d in ("qutlass", "triton_kernels"):  # sm100/120 and Python-only: not used on sm_90a
        (work / d).mkdir()
        (work / d / "README").write_text("not used by this build\n")
    stub = work / "fa" / FA3_STUB
    stub.write_text(fa3_stub_source({f: (work / "fa" / f).read_text() for f in FA3_NOT_BUILT}))
    placeholder = work / "placeholder.cpp"
    placeholder.write_text("// targets outside the subset are never built\n")
    swaps = {}
    for tgt, rel in BINDINGS.items():
        sub = vsrc / rel.replace(".cpp", "_subset.cpp")
        shutil.copy(vsrc / rel, sub)
        swaps[tgt] = f"{rel}={sub}"

    env = dict(os.environ, TORCH_CUDA_ARCH_LIST="9.0",
               VLLM_CUTLASS_SRC_DIR=str(work / "cutlass"), VLLM_FLASH_ATTN_SRC_DIR=str(work / "fa"),
               FLASH_MLA_SRC_DIR=str(work / "flashmla"), QUTLASS_SRC_DIR=str(work / "qutlass"),
               TRITON_KERNELS_SRC_DIR=str(work / "triton_kernels"))
    py = sys.executable
    pypath = subprocess.run([py, "-c", "import sys; print(':'.join(sys.path))"],
                            capture_output=True, text=True, check=True).stdout.strip()
    bdir = work / "build"
    cmake = ["cmake", "-S", str(vsrc), "-B", str(bdir), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
             "-DVLLM_TARGET_DEVICE=cuda", f"-DVLLM_PYTHON_EXECUTABLE={py}", f"-DVLLM_PYTHON_PATH={pypath}",
             f"-DFETCHCONTENT_BASE_DIR={work / 'fc'}", "-DNVCC_THREADS=1",
             f"-DCMAKE_PROJECT_INCLUDE={HOOK}", f"-DEAGLE3_KERNEL_TARGETS={';'.join(SUBSET)}",
             f"-DEAGLE3_KERNEL_PLACEHOLDER={placeholder}",
             f"-DEAGLE3_KERNEL_DEFS__vllm_fa3_C={';'.join(FA3_DEFS)}",
             f"-DEAGLE3_KERNEL_EXTRA__vllm_fa3_C={stub}",
             f"-DEAGLE3_KERNEL_FIRST={';'.join(BUILD_FIRST)}"]
    cmake += [f"-DEAGLE3_KERNEL_SRCS_{t}={';'.join(s)}" for t, s in SUBSET.items()]
    cmake += [f"-DEAGLE3_KERNEL_SWAP_{t}={s}" for t, s in swaps.items()]
    timings = {"configure_s": _run(cmake, log, env=env)}
    # One compile (csrc/python_api.cpp, about a minute) beside ninja's -j jobs.
    dg_log = out / "deepgemm-build.log"
    dg = _start_deepgemm(work, srcs, args.deepgemm_cxx, dg_log)
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
    deep_gemm = _finish_deepgemm(*dg, dg_log, out, args.deepgemm_cxx)
    for tgt, lib in libs.items():
        dest = out / LIB_PATHS[tgt] / lib.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(lib, dest)
    timings["total_s"] = round(time.monotonic() - t0, 1)
    steps = [ln.split("\t") for ln in (bdir / ".ninja_log").read_text().splitlines()[1:]]
    timings["slowest_objects_s"] = dict(sorted(
        ((st[3].rsplit("/", 1)[-1], round((int(st[1]) - int(st[0])) / 1000)) for st in steps if len(st) >= 4),
        key=lambda kv: -kv[1])[:6])
    timings["compile_steps"] = len(steps)
    report = {
        "targets": {t: {"library": f"{LIB_PATHS[t]}/{libs[t].name}", "bytes": libs[t].stat().st_size,
                        "sources": SUBSET[t]} for t in SUBSET},
        "fa3_definitions": FA3_DEFS,
        "fa3_not_built": {"files": FA3_NOT_BUILT, "raise_in": FA3_STUB},
        "schemas_without_kernel": not_built,
        "deep_gemm": deep_gemm,
        "sources_sha256": {k: v["sha256"] for k, v in srcs.items()} | {"vllm-src": staged.get("vllm-src")},
        "timings": timings, "jobs": args.jobs,
        "nvcc": subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1],
    }
    (out / "kernels.json").write_text(json.dumps(report, indent=1) + "\n")
    # One archive, small enough (xz: about a quarter) to come back from the
    # device and to be carried by later calls instead of rebuilding.
    with tarfile.open(out / "kernels-libs.tar.xz", "w:xz", preset=3) as tf:
        tf.add(out / "kernels.json", "kernels.json")
        tf.add(out / "vllm", "vllm")
        tf.add(out / "deep_gemm", "deep_gemm")
    print(json.dumps({k: report[k] for k in ("timings", "schemas_without_kernel", "deep_gemm")}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    head, _, rest = __doc__.partition("\n\n")
    ap = argparse.ArgumentParser(prog="kernels.py", description=head, epilog=rest,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stage", help="write the verified source archives into .device/kernels")
    s.add_argument("--cutlass-git", type=Path, help="a git clone of NVIDIA/cutlass")
    s.add_argument("--flash-attn-git", type=Path, help="a git clone of vllm-project/flash-attention")
    s.add_argument("--deepgemm-git", type=Path, help="a git clone of deepseek-ai/DeepGEMM")
    s.add_argument("--fmt-git", type=Path, help="a git clone of fmtlib/fmt")
    b = sub.add_parser("build", help="build the subset (needs nvcc, cmake, ninja, torch with CUDA)")
    b.add_argument("--out", required=True, help="where vllm/... and kernels.json go")
    b.add_argument("--work", default="/tmp/eagle3-kernels", help="scratch directory (emptied)")
    b.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 8)
    b.add_argument("--deepgemm-cxx", default=DEEPGEMM_CXX, help=f"C++ compiler for DeepGEMM (default {DEEPGEMM_CXX})")
    args = ap.parse_args(argv)
    return stage(args) if args.cmd == "stage" else build(args)


if __name__ == "__main__":
    run_main(TOOL, main)
