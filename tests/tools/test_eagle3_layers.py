# SPDX-License-Identifier: Apache-2.0
"""tools/eagle3_layers.py: `show` (what vLLM captures, and from where) and
`convert` (output-of-layer ids to vLLM's input-of-layer ids).

`show` reads configs through the installed vLLM (get_config, then the series'
get_eagle3_aux_layer_ids), so its tests need the series. `convert` is plain
JSON work; its tests check the written files byte for byte where nothing may
change, and value by value where something must.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from stack_tooling import run_tool
from tools import eagle3_layers, tiny_checkpoints
from tools._common import StackError

TOP = "eagle_aux_hidden_state_layer_ids"


def drafter_dir(tmp: Path, name: str, top: Any = None, nested: Any = None,
                nested_block: bool = True) -> Path:
    """A drafter directory: the tiny drafters' config (the shape published
    EAGLE-3 drafters use), with ids only where asked, and a weights file."""
    cfg = tiny_checkpoints.eagle3_drafter_config(
        target_hidden_size=128, target_vocab_size=tiny_checkpoints.VOCAB_SIZE,
        aux_layer_ids=None)
    if top is not None:
        cfg[TOP] = top
    if nested is not None:
        cfg["eagle_config"][TOP] = nested
    if not nested_block:
        del cfg["eagle_config"]
    d = tmp / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (d / "model.safetensors").write_bytes(os.urandom(4096))
    return d


def target_dir(tmp: Path, n: int, nested_text: bool = False) -> Path:
    d = tmp / f"target{n}{'_mm' if nested_text else ''}"
    d.mkdir()
    text = {"model_type": "deepseek_v3", "num_hidden_layers": n, "hidden_size": 128}
    cfg = {"model_type": "kimi_k25", "text_config": text} if nested_text else text
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def show(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert eagle3_layers.main(["show", *map(str, args)]) == 0
    return capsys.readouterr().out


# ---------------------------------------------------------------------------
# show
# ---------------------------------------------------------------------------


def test_show_top_level_ids(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = drafter_dir(tmp_path, "d", top=[1, 3, 6])
    out = show(capsys, d, "--target", target_dir(tmp_path, 6))
    assert "aux ids: [1, 3, 6]" in out
    assert "source: top-level eagle_aux_hidden_state_layer_ids" in out
    assert "vLLM captures: input of layer 1, input of layer 3, the final norm's input" in out
    assert "equivalently: output of layer 0, output of layer 2, output of layer 5" in out
    assert "id   6: the final norm's input (no layer 6) = output of layer 5, the last layer" in out


def test_show_nested_ids(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Where SpecForge and TorchSpec drafters keep them.
    d = drafter_dir(tmp_path, "d", nested=[2, 30, 58])
    out = show(capsys, d)
    assert "aux ids: [2, 30, 58]" in out
    assert "source: nested eagle_config.eagle_aux_hidden_state_layer_ids" in out
    assert "equivalently: output of layer 1, output of layer 29, output of layer 57" in out


def test_show_target_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = drafter_dir(tmp_path, "d")
    out = show(capsys, d, "--target", target_dir(tmp_path, 8, nested_text=True))
    assert "aux ids: [2, 4, 5]" in out
    assert "source: target default (2, n//2, n-3) with n = 8" in out
    out = show(capsys, d)
    assert "none in the drafter's config" in out and "pass --target" in out
    assert "aux ids: [" not in out


def test_show_id_zero_is_the_embedding(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = show(capsys, drafter_dir(tmp_path, "d", top=[0, 2]))
    assert "id   0: input of layer 0 (the embedding output)" in out
    assert "equivalently: the embedding output, output of layer 1" in out


def test_show_conflicting_ids_name_both(tmp_path: Path) -> None:
    d = drafter_dir(tmp_path, "d", top=[3, 31, 59], nested=[2, 30, 58])
    with pytest.raises(StackError) as err:
        eagle3_layers.main(["show", str(d)])
    msg = str(err.value)
    assert msg.startswith("vLLM refuses the drafter's ids: ")
    assert "eagle_config.eagle_aux_hidden_state_layer_ids" in msg
    assert "3, 31, 59" in msg and "2, 30, 58" in msg


def test_show_reads_the_agreeing_pair_the_converter_writes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = drafter_dir(tmp_path, "d", nested=[2, 30, 58])
    eagle3_layers.main(["convert", str(d), "--from", "output-of-layer"])
    capsys.readouterr()
    out = show(capsys, d)
    assert "aux ids: [3, 31, 59]" in out
    assert "input of layer 3, input of layer 31, input of layer 59" in out
    assert "equivalently: output of layer 2, output of layer 30, output of layer 58" in out


def test_show_flags_ids_past_the_target(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = show(capsys, drafter_dir(tmp_path, "d", top=[1, 3, 7]),
               "--target", target_dir(tmp_path, 6))
    assert "ids [7] are outside [0, 6]" in out


def test_show_flags_unsorted_ids(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = show(capsys, drafter_dir(tmp_path, "d", nested=[58, 2, 30]))
    assert "ids [58, 2, 30] are not strictly ascending" in out
    out = show(capsys, drafter_dir(tmp_path, "e", nested=[2, 30, 58]))
    assert "ascending" not in out


def test_show_without_the_series_says_so(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.config.speculative as spec

    monkeypatch.delattr(spec, "get_eagle3_aux_layer_ids", raising=False)
    with pytest.raises(StackError) as err:
        eagle3_layers.main(["show", str(drafter_dir(tmp_path, "d", top=[1, 3, 6]))])
    msg = str(err.value)
    assert "no get_eagle3_aux_layer_ids" in msg
    assert "stock vLLM or a build from before the EAGLE-3 series" in msg


# ---------------------------------------------------------------------------
# convert
# ---------------------------------------------------------------------------


def test_convert_in_place_output_of_layer(tmp_path: Path) -> None:
    d = drafter_dir(tmp_path, "d", top=[2, 30, 58], nested=[2, 30, 58])
    before = (d / "config.json").read_bytes()
    proc = run_tool("eagle3_layers", "convert", str(d), "--from", "output-of-layer")
    assert proc.returncode == 0, proc.stderr
    assert (d / "config.json.orig").read_bytes() == before
    new = json.loads((d / "config.json").read_text())
    old = json.loads(before)
    assert new[TOP] == [3, 31, 59]
    assert new["eagle_config"][TOP] == [3, 31, 59]
    assert new["eagle_config"]["use_aux_hidden_state"] is True
    # Nothing else changed, and key order is kept.
    for cfg in (new, old):
        cfg.pop(TOP)
        cfg["eagle_config"].pop(TOP)
    assert list(new) == list(old) and new == old
    assert "from [2, 30, 58]" in proc.stdout and "each id + 1" in proc.stdout


def test_convert_nested_only_writes_both(tmp_path: Path) -> None:
    d = drafter_dir(tmp_path, "d", nested=[2, 30, 58])
    eagle3_layers.main(["convert", str(d), "--from", "output-of-layer"])
    new = json.loads((d / "config.json").read_text())
    assert new[TOP] == new["eagle_config"][TOP] == [3, 31, 59]


def test_convert_input_of_layer_makes_nested_ids_explicit(tmp_path: Path) -> None:
    d = drafter_dir(tmp_path, "d", nested=[3, 31, 59])
    eagle3_layers.main(["convert", str(d), "--from", "input-of-layer"])
    new = json.loads((d / "config.json").read_text())
    assert new[TOP] == new["eagle_config"][TOP] == [3, 31, 59]


def test_convert_without_eagle_config_block(tmp_path: Path) -> None:
    d = drafter_dir(tmp_path, "d", top=[1, 3], nested_block=False)
    eagle3_layers.main(["convert", str(d), "--from", "output-of-layer"])
    new = json.loads((d / "config.json").read_text())
    assert new[TOP] == [2, 4]
    assert "eagle_config" not in new


def test_convert_ids_given_for_a_config_without_ids(tmp_path: Path) -> None:
    # speculators 0.4's trainer writes no ids: the user supplies the
    # data-generation ids.
    d = drafter_dir(tmp_path, "d")
    eagle3_layers.main(["convert", str(d), "--from", "output-of-layer", "--ids", "2,4,5"])
    new = json.loads((d / "config.json").read_text())
    assert new[TOP] == [3, 5, 6]
    assert TOP not in new["eagle_config"]


def test_convert_out_copies_and_leaves_the_source(tmp_path: Path) -> None:
    d = drafter_dir(tmp_path, "d", nested=[1, 3, 5])
    (d / "sub").mkdir()
    (d / "sub" / "tokenizer.json").write_text("{}")
    before = {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}
    out = tmp_path / "out"
    eagle3_layers.main(["convert", str(d), "--from", "output-of-layer", "--out", str(out),
                        "--target", str(target_dir(tmp_path, 6))])
    assert {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()} == before
    assert not (d / "config.json.orig").exists() and not (out / "config.json.orig").exists()
    new = json.loads((out / "config.json").read_text())
    assert new[TOP] == new["eagle_config"][TOP] == [2, 4, 6]
    assert (out / "model.safetensors").read_bytes() == before["model.safetensors"]
    assert (out / "sub" / "tokenizer.json").read_text() == "{}"
    # Hard links on one file system; the config is a new file, not the
    # source's inode written through.
    assert os.path.samefile(out / "model.safetensors", d / "model.safetensors")
    assert not os.path.samefile(out / "config.json", d / "config.json")


def refused(*args: str) -> str:
    with pytest.raises(StackError) as err:
        eagle3_layers.main(["convert", *args])
    return str(err.value)


def test_convert_refuses_a_second_in_place_conversion(tmp_path: Path) -> None:
    d = drafter_dir(tmp_path, "d", top=[2, 4])
    eagle3_layers.main(["convert", str(d), "--from", "output-of-layer"])
    once = (d / "config.json").read_bytes()
    msg = refused(str(d), "--from", "output-of-layer")
    assert "config.json.orig exists" in msg and "twice" in msg
    assert (d / "config.json").read_bytes() == once


def test_convert_refuses_conflicting_ids(tmp_path: Path) -> None:
    d = drafter_dir(tmp_path, "d", top=[3, 31, 59], nested=[2, 30, 58])
    before = (d / "config.json").read_bytes()
    msg = refused(str(d), "--from", "output-of-layer")
    assert "eagle_aux_hidden_state_layer_ids=[3, 31, 59]" in msg
    assert "eagle_config.eagle_aux_hidden_state_layer_ids=[2, 30, 58]" in msg
    assert (d / "config.json").read_bytes() == before
    assert not (d / "config.json.orig").exists()


def test_convert_refuses_a_config_without_ids(tmp_path: Path) -> None:
    msg = refused(str(drafter_dir(tmp_path, "d")), "--from", "output-of-layer")
    assert "sets neither" in msg and "--ids" in msg


def test_convert_refuses_ids_contradicting_the_config(tmp_path: Path) -> None:
    msg = refused(str(drafter_dir(tmp_path, "d", top=[2, 4])), "--from", "output-of-layer",
                  "--ids", "1,4")
    assert "contradicts" in msg


def test_convert_refuses_unsorted_ids(tmp_path: Path) -> None:
    msg = refused(str(drafter_dir(tmp_path, "d", nested=[58, 2, 30])), "--from",
                  "output-of-layer")
    assert "not ascending" in msg and "[58, 2, 30]" in msg


def test_convert_refuses_ids_past_the_target(tmp_path: Path) -> None:
    # Output of layer 6 does not exist in a 6-layer target (layers 0..5).
    d = drafter_dir(tmp_path, "d", top=[1, 3, 6])
    msg = refused(str(d), "--from", "output-of-layer", "--target", str(target_dir(tmp_path, 6)))
    assert "[7]" in msg and "outside [0, 6]" in msg
    assert not (d / "config.json.orig").exists()
    # The same ids counted as layer inputs fit.
    eagle3_layers.main(["convert", str(d), "--from", "input-of-layer", "--target",
                        str(tmp_path / "target6")])


def test_convert_refuses_an_existing_out_dir(tmp_path: Path) -> None:
    d = drafter_dir(tmp_path, "d", top=[2, 4])
    (tmp_path / "out").mkdir()
    assert "must name a new directory" in refused(str(d), "--from", "output-of-layer",
                                                  "--out", str(tmp_path / "out"))


def test_convert_requires_the_convention(tmp_path: Path) -> None:
    d = drafter_dir(tmp_path, "d", top=[2, 4])
    proc = run_tool("eagle3_layers", "convert", str(d))
    assert proc.returncode == 2
    assert "--from" in proc.stderr
    assert not (d / "config.json.orig").exists()


def test_convert_cli_error_is_one_line(tmp_path: Path) -> None:
    proc = run_tool("eagle3_layers", "convert", str(tmp_path / "missing"), "--from",
                    "output-of-layer")
    assert proc.returncode == 1
    assert proc.stderr.startswith("[eagle3-layers] error: ")
    assert "config.json does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------
# Published configs (tests/v1/spec_decode/published_configs: repository, path
# and commit of each in its PROVENANCE.md). SpecForge keeps its ids nested and
# counts layer outputs.
# ---------------------------------------------------------------------------

PUBLISHED = Path(__file__).resolve().parents[1] / "v1" / "spec_decode" / "published_configs"


def published(tmp: Path, name: str) -> Path:
    d = tmp / name
    d.mkdir()
    shutil.copyfile(PUBLISHED / name / "config.json", d / "config.json")
    return d


def test_published_specforge_deepseek_v3_drafter(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Nested [1, 29, 57]; the target is the vendored DeepSeek-R1-0528 config
    # (61 layers).
    d = published(tmp_path, "specforge-deepseek-v3-671b-eagle3")
    target = PUBLISHED / "deepseek-r1-0528-target-ttmetal"
    out = show(capsys, d, "--target", target)
    assert "aux ids: [1, 29, 57]" in out
    assert "source: nested eagle_config.eagle_aux_hidden_state_layer_ids" in out
    # What vLLM would feed as read: one layer early.
    assert "equivalently: output of layer 0, output of layer 28, output of layer 56" in out
    before = json.loads((d / "config.json").read_text())
    eagle3_layers.main(["convert", str(d), "--from", "output-of-layer", "--target", str(target)])
    capsys.readouterr()
    new = json.loads((d / "config.json").read_text())
    assert new[TOP] == new["eagle_config"][TOP] == [2, 30, 58]
    assert {k: v for k, v in new.items() if k not in (TOP, "eagle_config")} == {
        k: v for k, v in before.items() if k != "eagle_config"}
    out = show(capsys, d, "--target", target)
    assert "aux ids: [2, 30, 58]  (source: top-level eagle_aux_hidden_state_layer_ids)" in out
    assert "equivalently: output of layer 1, output of layer 29, output of layer 57" in out


def test_published_specforge_kimi_k25_drafter(tmp_path: Path) -> None:
    d = published(tmp_path, "specforge-kimi-k25-eagle3")
    out = tmp_path / "vllm"
    eagle3_layers.main(["convert", str(d), "--from", "output-of-layer", "--out", str(out)])
    new = json.loads((out / "config.json").read_text())
    assert new[TOP] == new["eagle_config"][TOP] == [3, 31, 59]
    assert (d / "config.json").read_bytes() == (
        PUBLISHED / "specforge-kimi-k25-eagle3" / "config.json").read_bytes()
