# SPDX-License-Identifier: Apache-2.0
"""device_run.sh's plan on CPU: setup once, then the stages in order; a
stage that would not fit its measured seconds is skipped with a line and
the later ones still run; what each finished stage left is under $OUT after
it ends, so a call cut in a later stage (by its own limit, or killed whole as
the device tool kills it) still returns every earlier result; an artifact
made on the device comes back with its key, and device_cache.py put takes it.

The stages are stand-ins (``sh-NAME``: the shell command in ``$SH_NAME``):
the real ones need a GPU and minutes each; what is tested here is the
script around them. Setup is skipped (SKIP_SETUP=1): it installs vLLM's
CUDA build."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tarfile
import time

import pytest

import gpu_e2e_helpers  # noqa: F401 - puts tools/gpu_harness on sys.path
import device_cache as dc

REPO = gpu_e2e_helpers.REPO_ROOT
H = "tools/gpu_harness"


@pytest.fixture
def root(tmp_path, monkeypatch):
    """A checkout with what device_run.sh and device_cache.py read."""
    root = tmp_path / "tree"
    for rel in ("tools/__init__.py", "tools/_common.py", f"{H}/__init__.py", f"{H}/device_run.sh",
                f"{H}/device_cache.py", f"{H}/wheels.txt", f"{H}/kernels.py", f"{H}/kernel_subset.cmake",
                *dc.PAIR_CODE):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, root / rel)
    monkeypatch.setenv("VLLM_EAGLE3_DEVICE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("VLLM_EAGLE3_DEVICE_TORCH", raising=False)
    return root


def _env(out, budget, **stages):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SH_", "NEED_S_", "KERNELS", "DEVICE_TORCH"))}
    env.update(SKIP_SETUP="1", OUT=str(out), BUDGET_S=str(budget), FLASHINFER_WORKSPACE_BASE=str(out.parent / "fi-ws"),
               OUT_WORK=str(out.parent / "work"), **stages)
    return env


def _run(root, out, budget, names, **stages):
    r = subprocess.run(["bash", f"{H}/device_run.sh", *names], cwd=root, env=_env(out, budget, **stages),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def _members(tgz):
    with tarfile.open(tgz) as t:
        return {os.path.normpath(m.name): t.extractfile(m).read().decode() for m in t.getmembers() if m.isfile()}


RESULT = 'mkdir -p "$EAGLE3_GPU_RESULTS_DIR" && echo "{\\"stage\\": \\"$1\\"}" >"$EAGLE3_GPU_RESULTS_DIR/$1.json"'


def _result_stage(name):
    return f"set -- {name}; {RESULT}; echo log of {name}"


def test_stage_over_its_limit_keeps_earlier_results_and_the_plan_goes_on(root, tmp_path):
    out = tmp_path / "out"
    _run(root, out, 60, ["sh-one", "sh-slow", "sh-three"], SH_ONE=_result_stage("one"),
         SH_SLOW="echo started; sleep 60", SH_THREE=_result_stage("three"), SH_LIMIT_S="3")
    summary = (out / "summary.log").read_text()
    assert re.search(r"== sh-one rc=0 .*\n== sh-slow rc=124 .*\n== sh-three rc=0", summary), summary
    assert set(_members(out / "results.tgz")) == {"results/one.json", "results/three.json"}
    logs = _members(out / "logs.tgz")
    assert "log of one" in logs["sh-one.log"] and "started" in logs["sh-slow.log"]
    assert sorted(p.name for p in out.iterdir()) == ["logs.tgz", "results.tgz", "summary.log"]
    assert not (tmp_path / "work").exists()


def test_stage_that_would_not_fit_its_measured_seconds_is_skipped(root, tmp_path):
    out = tmp_path / "out"
    r = _run(root, out, 100, ["sh-big", "sh-small"], SH_BIG=_result_stage("big"), NEED_S_SH_BIG="500",
             SH_SMALL=_result_stage("small"), NEED_S_SH_SMALL="30")
    assert re.search(r"== sh-big: skipped, measured 500s, \d+s left", r.stdout)
    assert "== sh-small rc=0" in (out / "summary.log").read_text()
    assert set(_members(out / "results.tgz")) == {"results/small.json"}


def test_measured_seconds_come_from_the_table(root, tmp_path):
    """A real stage name, with nothing set: the table's 470 s for acceptance
    does not fit in 100 s, so pytest is never started."""
    out = tmp_path / "out"
    r = _run(root, out, 100, ["acceptance"])
    assert re.search(r"== acceptance: skipped, measured 470s, \d+s left", r.stdout)


def test_call_killed_mid_stage_keeps_every_finished_stage(root, tmp_path):
    """The device tool kills the whole command at its limit: what the
    finished stages left must already be under $OUT, whole."""
    out = tmp_path / "out"
    p = subprocess.Popen(["bash", f"{H}/device_run.sh", "sh-one", "sh-two", "sh-hang", "sh-never"], cwd=root,
                         env=_env(out, 500, SH_ONE=_result_stage("one"), SH_TWO=_result_stage("two"),
                                  SH_HANG="echo hanging; sleep 300", SH_NEVER=_result_stage("never")),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while "sh-hang (limit" not in ((tmp_path / "work" / "sh-hang.log").read_text()
                                       if (tmp_path / "work" / "sh-hang.log").exists() else ""):
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.2)
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    assert set(_members(out / "results.tgz")) == {"results/one.json", "results/two.json"}
    assert {"sh-one.log", "sh-two.log"} <= set(_members(out / "logs.tgz"))
    assert "== sh-two rc=0" in (out / "summary.log").read_text()
    assert sorted(p.name for p in out.iterdir()) == ["logs.tgz", "results.tgz", "summary.log"]


def test_artifact_made_on_the_device_comes_back_keyed_and_put_takes_it(root, tmp_path):
    """prepare.py laid the pair's key file (no cached pair); the stage that
    trains it leaves pair-dsv3.tgz; it comes back with artifacts.json, and
    put stores it under the key prepare.py computed, so the next prepare.py
    lays it."""
    dc.lay("pair-dsv3", dc.inputs("pair-dsv3", root), root)
    out = tmp_path / "out"
    _run(root, out, 60, ["sh-train"], SH_TRAIN='echo trained >"$OUT/pair-dsv3.tgz"')
    assert (out / "pair-dsv3.tgz").read_text() == "trained\n"
    manifest = json.loads((out / "artifacts.json").read_text())
    torch = manifest["pair-dsv3.tgz"]["inputs"]["device torch"]  # python3's torch here, or "unknown"
    os.environ["VLLM_EAGLE3_DEVICE_TORCH"] = torch
    try:
        dc.put(out, root)
        assert dc.lay("pair-dsv3", dc.inputs("pair-dsv3", root), root).startswith("cached pair-dsv3.tgz laid")
    finally:
        del os.environ["VLLM_EAGLE3_DEVICE_TORCH"]


def _carried_kernels(root, tmp_path, torch="2.11.0+cu130"):
    """kernels.py stage's work: the staged sources' digests, and a build
    (stand-in bytes) laid from the cache with its key file."""
    (root / ".device/kernels").mkdir(parents=True)
    (root / ".device/kernels/sources.json").write_text(json.dumps({"vllm-src": "a" * 64}))
    ins = dc.inputs("kernels", root, torch=torch)
    (tmp_path / "kernels-libs.tar.xz").write_bytes(b"stand-in build")
    dc.store("kernels", tmp_path / "kernels-libs.tar.xz", ins, "test")
    assert dc.lay("kernels", ins, root).startswith("cached")


def test_carried_kernels_of_this_tree_and_torch_skip_the_build(root, tmp_path):
    _carried_kernels(root, tmp_path)
    out = tmp_path / "out"
    r = _run(root, out, 60, ["kernels", "sh-k"], DEVICE_TORCH="2.11.0+cu130", SH_K='echo "KERNELS=$KERNELS"')
    assert "== .device/kernels/kernels-libs.tar.xz: kernels-" in r.stdout
    assert "== kernels: the carried kernels-libs.tar.xz is used, not rebuilt" in r.stdout
    assert "== kernels (limit" not in r.stdout
    assert "KERNELS=.device/kernels/kernels-libs.tar.xz" in _members(out / "logs.tgz")["sh-k.log"]


@pytest.mark.parametrize("change,why", [
    (lambda root: None, "device torch changed (2.11.0+cu130 -> 2.12.0+cu130)"),
    (lambda root: (root / H / "kernel_subset.cmake").write_text("# changed after staging\n"),
     "kernel_subset.cmake changed"),
], ids=["torch", "tree"])
def test_carried_kernels_of_another_torch_or_tree_are_not_used(root, tmp_path, change, why):
    """A device with another torch, or a tree changed after kernels.py
    stage laid the build: the carried build is removed, and with the kernels
    stage in the plan it would be built."""
    _carried_kernels(root, tmp_path)
    change(root)
    out = tmp_path / "out"
    r = _run(root, out, 60, ["sh-k"], DEVICE_TORCH="2.12.0+cu130" if "torch" in why else "2.11.0+cu130",
             SH_K='echo "KERNELS=$KERNELS."')
    assert f"== .device/kernels/kernels-libs.tar.xz not used (removed): {why}" in r.stdout
    assert "KERNELS=." in _members(out / "logs.tgz")["sh-k.log"]
    assert not (root / ".device/kernels/kernels-libs.tar.xz").exists()


def test_carried_pair_of_a_changed_tree_is_not_used(root, tmp_path):
    ins = dc.inputs("pair-kimi", root, torch="2.11.0+cu130")
    (tmp_path / "pair-kimi.tgz").write_bytes(b"trained")
    dc.store("pair-kimi", tmp_path / "pair-kimi.tgz", ins, "test")
    dc.lay("pair-kimi", ins, root)
    (root / "tests/e2e/gpu/serving_pairs.py").write_text("# trains otherwise now\n")
    r = _run(root, tmp_path / "out", 60, ["sh-k"], DEVICE_TORCH="2.11.0+cu130", SH_K="true")
    assert ("== .device/pairs/pair-kimi.tgz not used (removed): tests/e2e/gpu/serving_pairs.py changed"
            in r.stdout)


def test_flashinfer_jit_cache_comes_back_when_it_grew(root, tmp_path):
    """A stage that compiles a FlashInfer module (a stand-in file where
    FlashInfer's JIT puts one) returns the cache as fi-jit.tar.xz, laid out
    from the workspace as device_setup.sh unpacks it; one that only writes
    FlashInfer's log returns none."""
    cache = "$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer/0.6.3/90a"
    _run(root, tmp_path / "out1", 60, ["sh-log"],
         SH_LOG=f'mkdir -p {cache} && echo used >>{cache}/../../flashinfer_jit.log')
    assert not (tmp_path / "out1" / "fi-jit.tar.xz").exists()
    out = tmp_path / "out2"
    _run(root, out, 60, ["sh-jit"], SH_JIT=f'mkdir -p {cache}/cached_ops/m && echo module >{cache}/cached_ops/m/m.so')
    with tarfile.open(out / "fi-jit.tar.xz") as t:
        assert ".cache/flashinfer/0.6.3/90a/cached_ops/m/m.so" in t.getnames()
    assert json.loads((out / "artifacts.json").read_text())["fi-jit.tar.xz"]["kind"] == "fi-jit"


def test_docs_plan_has_the_measured_seconds_device_run_uses():
    """docs/gpu.md's plan lists each stage's measured seconds; device_run.sh
    skips by the same numbers."""
    script = (REPO / H / "device_run.sh").read_text()
    func = re.search(r"(?ms)^measured_s\(\) \{.*?^\}", script).group(0)
    doc = (REPO / "docs/gpu.md").read_text()
    plan = doc[doc.index("### The plan"):]
    rows = re.findall(r"(?m)^\| \d+ \| `([^`]+)` \| ([^|]+?) \|", plan)
    assert rows
    for stage, measured in rows:
        got = subprocess.run(["bash", "-c", f"{func}\nmeasured_s '{stage}'"], capture_output=True,
                             text=True, check=True).stdout.strip()
        m = re.match(r"(\d+) s", measured)
        assert got == (m.group(1) if m else "0"), (stage, measured, got)
