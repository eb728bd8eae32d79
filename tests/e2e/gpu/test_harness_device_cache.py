# SPDX-License-Identifier: Apache-2.0
"""device_cache.py on CPU: each artifact's key changes when any of its
inputs changes (and not when kernels.py's staging side does), a cached or
laid artifact of other inputs is never used and the line names the input
that changed, and what comes back from a device is stored only after its
digest and inputs check out.

The trees are copies of this checkout's own files (kernels.py with its real
section markers, wheels.txt, the pair code). The artifacts are stand-ins:
building the kernels, FlashInfer's JIT cache or a trained pair needs a GPU,
and the cache reads them only as bytes (the kernels archive's kernels.json
is written as kernels.py build writes it)."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import tarfile

import pytest

import gpu_e2e_helpers  # noqa: F401 - puts tools/gpu_harness on sys.path
import device_cache as dc
from tools._common import StackError

REPO = gpu_e2e_helpers.REPO_ROOT
H = "tools/gpu_harness"
SOURCES = {"vllm-src": "a" * 64, "nvidia_cutlass-4.2.0.0-py3-none-any.whl": "b" * 64}


def make_tree(root):
    """The files every kind's inputs are read from, copied from this
    checkout, with a staged .device/ (sources.json, the two FlashInfer wheels
    wheels.txt pins, as stand-in bytes)."""
    for rel in (f"{H}/kernels.py", f"{H}/kernel_subset.cmake", f"{H}/wheels.txt", f"{H}/fi_prefill.py",
                *dc.PAIR_CODE):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, root / rel)
    (root / ".device/kernels").mkdir(parents=True)
    (root / ".device/kernels/sources.json").write_text(json.dumps(SOURCES))
    pins = dc.wheel_pins(dc.Tree(root))
    (root / ".device/whl").mkdir()
    for name in dc.FI_WHEELS:
        (root / f".device/whl/{name}-{pins[name]}-py3-none-any.whl").write_bytes(f"{name} wheel".encode())
    return root


@pytest.fixture
def tree(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_EAGLE3_DEVICE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("VLLM_EAGLE3_DEVICE_TORCH", raising=False)
    return make_tree(tmp_path / "tree")


def _edit(path, old, new):
    text = path.read_text()
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new))


def _append(path):
    path.write_text(path.read_text() + "\n# changed\n")


def _set_sources(root, **kw):
    p = root / ".device/kernels/sources.json"
    p.write_text(json.dumps({**json.loads(p.read_text()), **kw}))


# One change per input of each kind: (kind, the input's name, the change).
CHANGES = [
    ("kernels", "source vllm-src", lambda r: _set_sources(r, **{"vllm-src": "c" * 64})),
    ("kernels", "source nvidia_cutlass-4.2.0.0-py3-none-any.whl",
     lambda r: _set_sources(r, **{"nvidia_cutlass-4.2.0.0-py3-none-any.whl": "d" * 64})),
    ("kernels", "kernels.py (build side)",
     lambda r: _edit(r / H / "kernels.py", 'BUILD_FIRST = ["_moe_C"]', 'BUILD_FIRST = []')),
    ("kernels", "kernels.py (build side)",
     lambda r: _edit(r / H / "kernels.py", '"-DCMAKE_BUILD_TYPE=Release"', '"-DCMAKE_BUILD_TYPE=Debug"')),
    ("kernels", "kernel_subset.cmake", lambda r: (r / H / "kernel_subset.cmake").write_text("# other\n")),
    ("fi-jit", "fi_prefill.py", lambda r: _append(r / H / "fi_prefill.py")),
    *[("fi-jit", f"wheel {w}", lambda r, w=w: (r / ".device/whl" / w).write_bytes(b"rebuilt"))
      for w in ("flashinfer_python-0.6.3-py3-none-any.whl", "apache_tvm_ffi-0.1.15.post2-py3-none-any.whl")],
    *[(kind, rel, lambda r, rel=rel: _append(r / rel))
      for kind in ("pair-dsv3", "pair-kimi") for rel in dc.PAIR_CODE],
    ("pair-dsv3", "transformers",
     lambda r: _edit(r / H / "wheels.txt", "transformers==4.57.6", "transformers==4.57.5")),
]


@pytest.mark.parametrize("kind,name,change", CHANGES, ids=[f"{k}:{n}" for k, n, _ in CHANGES])
def test_key_changes_when_an_input_changes(tree, kind, name, change):
    before = dc.inputs(kind, tree)
    change(tree)
    after = dc.inputs(kind, tree)
    assert dc.make_key(kind, after) != dc.make_key(kind, before)
    assert dc.changed(before, after).startswith(f"{name} changed")


@pytest.mark.parametrize("kind", list(dc.ARTIFACTS))
def test_key_changes_with_the_device_torch(tree, kind, monkeypatch):
    before = dc.make_key(kind, dc.inputs(kind, tree))
    monkeypatch.setenv("VLLM_EAGLE3_DEVICE_TORCH", "2.12.0+cu130")
    assert dc.make_key(kind, dc.inputs(kind, tree)) != before


def test_kernels_key_ignores_the_staging_side_of_kernels_py(tree):
    """stage (laying from the cache among it), the docstring and main() do
    not change what the build makes: a build made before they changed
    stays valid."""
    before = dc.inputs("kernels", tree)
    k = tree / H / "kernels.py"
    _edit(k, '"""Build vLLM 0.16.0', '"""Rebuilt docs: build vLLM 0.16.0')
    _edit(k, "def _sdist_subset() -> bytes:", "def _sdist_subset() -> bytes:\n    pass  # a staging change")
    _edit(k, "def main(argv: list[str] | None = None) -> int:",
          "def main(argv: list[str] | None = None) -> int:\n    pass")
    assert dc.inputs("kernels", tree) == before


def test_build_recipe_refuses_a_kernels_py_without_its_sections(tree):
    k = tree / H / "kernels.py"
    _edit(k, dc.STAGE_SECTION[0], "# --- staging")
    with pytest.raises(StackError, match="where did the build code move"):
        dc.inputs("kernels", tree)


def _artifact(path, data=b"stand-in artifact"):
    path.write_bytes(data)
    return path


def test_matching_artifact_is_laid_with_its_key_file(tree, tmp_path):
    ins = dc.inputs("fi-jit", tree)
    key = dc.store("fi-jit", _artifact(tmp_path / "fi-jit.tar.xz", b"jit cache"), ins, "test")
    line = dc.lay("fi-jit", ins, tree)
    assert line.startswith(f"cached fi-jit.tar.xz laid into .device/fi-jit ({key}")
    assert (tree / ".device/fi-jit/fi-jit.tar.xz").read_bytes() == b"jit cache"
    assert json.loads((tree / ".device/fi-jit/fi-jit.key.json").read_text())["key"] == key
    assert "already holds" in dc.lay("fi-jit", ins, tree)


def test_stale_cached_artifact_is_refused_naming_what_changed(tree, tmp_path):
    dc.store("kernels", _artifact(tmp_path / "kernels-libs.tar.xz"), dc.inputs("kernels", tree), "test")
    (tree / H / "kernel_subset.cmake").write_text("# other\n")
    line = dc.lay("kernels", dc.inputs("kernels", tree), tree)
    assert "is stale, not used: kernel_subset.cmake changed" in line
    assert not (tree / ".device/kernels/kernels-libs.tar.xz").exists()
    assert json.loads((tree / ".device/kernels/kernels-libs.key.json").read_text())["laid"] is False


def test_laid_artifact_of_other_inputs_is_removed(tree, tmp_path):
    ins = dc.inputs("pair-dsv3", tree)
    dc.store("pair-dsv3", _artifact(tmp_path / "pair-dsv3.tgz"), ins, "test")
    dc.lay("pair-dsv3", ins, tree)
    (tree / "tools/gpu_harness/training.py").write_text("# retrained\n")
    line = dc.lay("pair-dsv3", dc.inputs("pair-dsv3", tree), tree)
    assert line.startswith("removed the stale .device/pairs/pair-dsv3.tgz: tools/gpu_harness/training.py changed")
    assert not (tree / ".device/pairs/pair-dsv3.tgz").exists()


def test_laid_artifact_changed_since_it_was_laid_is_laid_again(tree, tmp_path):
    ins = dc.inputs("fi-jit", tree)
    dc.store("fi-jit", _artifact(tmp_path / "fi-jit.tar.xz", b"jit cache"), ins, "test")
    dc.lay("fi-jit", ins, tree)
    (tree / ".device/fi-jit/fi-jit.tar.xz").write_bytes(b"overwritten")
    line = dc.lay("fi-jit", ins, tree)
    assert line.startswith("removed the stale .device/fi-jit/fi-jit.tar.xz: its sha256 is not its key file's; "
                           "cached fi-jit.tar.xz laid")
    assert (tree / ".device/fi-jit/fi-jit.tar.xz").read_bytes() == b"jit cache"


def test_laid_artifact_without_a_key_file_is_removed(tree):
    (tree / ".device/pairs").mkdir()
    _artifact(tree / ".device/pairs/pair-kimi.tgz")
    line = dc.lay("pair-kimi", dc.inputs("pair-kimi", tree), tree)
    assert "no key file says what it was made of" in line
    assert not (tree / ".device/pairs/pair-kimi.tgz").exists()


def test_corrupt_cache_entry_is_refused(tree, tmp_path):
    ins = dc.inputs("fi-jit", tree)
    key = dc.store("fi-jit", _artifact(tmp_path / "fi-jit.tar.xz"), ins, "test")
    (dc.cache_root() / key / "fi-jit.tar.xz").write_bytes(b"bit rot")
    with pytest.raises(StackError, match="its key.json says"):
        dc.lay("fi-jit", ins, tree)


def kernels_archive(path, sources):
    """A kernels-libs.tar.xz as kernels.py build packs it: kernels.json (its
    ``sources`` as build records them) and the libraries (stand-in bytes)."""
    rec = {"sources": {"vllm-src": {"from": "vllm-0.16.0.tar.gz", "sha256": sources["vllm-src"]},
                       "nvidia-cutlass": {"from": "nvidia_cutlass-4.2.0.0-py3-none-any.whl",
                                          "sha256": sources["nvidia_cutlass-4.2.0.0-py3-none-any.whl"]}}}
    with tarfile.open(path, "w:xz") as t:
        for name, data in (("kernels.json", json.dumps(rec).encode()), ("vllm/_C.abi3.so", b"\x7fELF")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return path


def _device_call(tree, tmp_path, kind, make, torch="2.11.0+cu130"):
    """What a device call returns: stage / prepare lay the key file (no
    cached artifact), the device makes the artifact and seals it."""
    dc.lay(kind, dc.inputs(kind, tree), tree)
    ret = tmp_path / "returned"
    ret.mkdir(exist_ok=True)
    f = make(ret / dc.ARTIFACTS[kind][0])
    dc.seal(ret, torch, [f], root=tree)
    return ret, f


def test_put_stores_what_came_back_and_stage_lays_it(tree, tmp_path):
    ret, _ = _device_call(tree, tmp_path, "kernels", lambda p: kernels_archive(p, SOURCES))
    (line,) = dc.put(ret, tree)
    key = dc.make_key("kernels", dc.inputs("kernels", tree))
    assert line == f"stored kernels-libs.tar.xz as {key}"
    assert dc.lay("kernels", dc.inputs("kernels", tree), tree).startswith("cached kernels-libs.tar.xz laid")


def test_put_refuses_an_artifact_whose_digest_differs(tree, tmp_path):
    ret, f = _device_call(tree, tmp_path, "pair-kimi", _artifact)
    f.write_bytes(b"cut short")
    with pytest.raises(StackError, match="refused pair-kimi.tgz: pair-kimi.tgz: sha256"):
        dc.put(ret, tree)
    assert not dc.entries("pair-kimi")


def test_put_refuses_an_artifact_of_inputs_no_longer_current(tree, tmp_path):
    ret, _ = _device_call(tree, tmp_path, "fi-jit", _artifact)
    _append(tree / H / "fi_prefill.py")
    with pytest.raises(StackError, match="no longer current: fi_prefill.py changed"):
        dc.put(ret, tree)
    assert not dc.entries("fi-jit")


def test_put_refuses_kernels_built_from_other_sources_than_its_key(tree, tmp_path):
    ret, _ = _device_call(tree, tmp_path, "kernels",
                          lambda p: kernels_archive(p, {**SOURCES, "vllm-src": "e" * 64}))
    with pytest.raises(StackError, match="records other sources than its key: source vllm-src changed"):
        dc.put(ret, tree)


def test_put_keys_on_the_torch_the_device_had(tree, tmp_path):
    ret, _ = _device_call(tree, tmp_path, "pair-dsv3", _artifact, torch="2.12.0+cu130")
    (line,) = dc.put(ret, tree)
    assert "made on torch 2.12.0+cu130; the expected device torch is 2.11.0+cu130" in line
    assert "no cached pair-dsv3.tgz" in dc.lay("pair-dsv3", dc.inputs("pair-dsv3", tree), tree)


def _git(root, *args):
    subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                   check=True, capture_output=True)


def test_import_shared_keys_an_outside_build_on_the_commit_it_was_built_at(tree, tmp_path):
    """The kernels of a folder made by hand (a README with the digests) get
    the key kernels.py stage computes today when the build side of the
    commit they were built at is today's; a later change to it makes them
    stale."""
    _git(tree, "init", "-q")
    _git(tree, "add", "-A", "tools")
    _git(tree, "commit", "-q", "-m", "built here")
    shared = tmp_path / "shared"
    shared.mkdir()
    f = kernels_archive(shared / "kernels-libs.tar.xz", SOURCES)
    (shared / "README.md").write_text(f"sha256:\n- kernels-libs.tar.xz {dc.sha256_path(f)}\n")
    dc.import_shared(shared, "HEAD", "2.11.0+cu130", tree)
    assert dc.lay("kernels", dc.inputs("kernels", tree), tree).startswith("cached kernels-libs.tar.xz laid")
    _edit(tree / H / "kernels.py", 'BUILD_FIRST = ["_moe_C"]', 'BUILD_FIRST = []')
    assert "stale, not used: kernels.py (build side) changed" in dc.lay("kernels", dc.inputs("kernels", tree), tree)


def test_import_shared_refuses_a_file_whose_digest_is_not_the_readme_s(tree, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    kernels_archive(shared / "kernels-libs.tar.xz", SOURCES)
    (shared / "README.md").write_text(f"- kernels-libs.tar.xz {'0' * 64}\n")
    with pytest.raises(StackError, match="README.md says 000000000000"):
        dc.import_shared(shared, "HEAD", "2.11.0+cu130", tree)


def test_prepare_lays_the_jit_cache_and_the_pairs_it_finds(tree, tmp_path, monkeypatch, capsys):
    """prepare.py's main, its staging of vLLM and the wheels stood in (they
    download the official wheel): after the wheels, it lays what the cache
    holds for them."""
    import prepare

    _git(tree, "init", "-q")
    (tree / ".device/vllm").mkdir(parents=True)
    (tree / ".device/vllm/vllm-py.tar.xz").write_bytes(b"staged")
    monkeypatch.setattr(prepare, "REPO_ROOT", tree)
    monkeypatch.setattr(prepare, "DEVICE_DIR", tree / ".device")
    monkeypatch.setattr(prepare, "find_wheel", lambda: (tmp_path / "vllm.whl", "0" * 64))
    monkeypatch.setattr(prepare, "stage_vllm", lambda *a, **k: {"variant": "stand-in"})
    monkeypatch.setattr(prepare, "stage_wheels", lambda *a, **k: [])
    key = dc.store("fi-jit", _artifact(tmp_path / "fi-jit.tar.xz"), dc.inputs("fi-jit", tree), "test")
    assert prepare.main(["--no-download"]) == 0
    out = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[prepare]")]
    assert out[0].startswith(f"[prepare] cached fi-jit.tar.xz laid into .device/fi-jit ({key}")
    assert out[1].startswith("[prepare] no cached pair-dsv3.tgz") and out[2].startswith("[prepare] no cached pair-kimi")
    assert (tree / ".device/fi-jit/fi-jit.tar.xz").is_file()
    assert {p.name for p in (tree / ".device/pairs").iterdir()} == {"pair-dsv3.key.json", "pair-kimi.key.json"}


def test_kernels_stage_lays_the_build_of_what_it_staged(tree, tmp_path, monkeypatch, capsys):
    """kernels.py stage with the pinned sdist and CUTLASS wheel (from the
    download cache, verified): the first stage finds nothing cached; once
    the cache holds a build of those inputs, the next stage lays it."""
    import kernels

    monkeypatch.setattr(kernels, "REPO_ROOT", tree)
    monkeypatch.setattr(kernels, "STAGE_DIR", tree / ".device/kernels")
    kernels.stage(None)
    assert "[kernels] no cached kernels-libs.tar.xz" in capsys.readouterr().out
    key = dc.store("kernels", _artifact(tmp_path / "kernels-libs.tar.xz"), dc.inputs("kernels", tree), "test")
    kernels.stage(None)
    assert f"[kernels] cached kernels-libs.tar.xz laid into .device/kernels ({key}" in capsys.readouterr().out
    assert (tree / ".device/kernels/kernels-libs.tar.xz").read_bytes() == b"stand-in artifact"
