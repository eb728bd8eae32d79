# SPDX-License-Identifier: Apache-2.0
"""`vllm-eagle3 show` (what vLLM captures, and from where) and `convert`
(output-of-layer ids to vLLM's input-of-layer ids), through the clone's entry
point tools/eagle3_layers.py (the installed command: test_vllm_eagle3_cli.py).

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
from tools.vllm_eagle3._base import CONVERTED, ToolError

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


def show(capsys: pytest.CaptureFixture[str], *args: str, status: int = 0) -> str:
    code = eagle3_layers.main(["show", *map(str, args)])
    out = capsys.readouterr().out
    assert code == status, out
    return out


def refused(*args: str) -> str:
    with pytest.raises(ToolError) as err:
        eagle3_layers.main(list(args))
    return str(err.value)


@pytest.mark.parametrize("ids, target, present, absent", [
    ({"top": [1, 3, 6]}, (6,), [
        "aux ids: [1, 3, 6]", "source: top-level eagle_aux_hidden_state_layer_ids",
        "vLLM captures: input of layer 1, input of layer 3, the final norm's input",
        "equivalently: output of layer 0, output of layer 2, output of layer 5",
        "id   6: the final norm's input (no layer 6) = output of layer 5, the last layer"], []),
    # Where SpecForge and TorchSpec drafters keep them.
    ({"nested": [2, 30, 58]}, None, [
        "aux ids: [2, 30, 58]", "source: nested eagle_config.eagle_aux_hidden_state_layer_ids",
        "equivalently: output of layer 1, output of layer 29, output of layer 57"], ["ascending"]),
    # The default of a multimodal target (num_hidden_layers in text_config).
    ({}, (8, True), ["aux ids: [2, 4, 5]", "source: target default (2, n//2, n-3) with n = 8"], []),
    ({}, None, ["none in the drafter's config", "pass --target"], ["aux ids: ["]),
    ({"top": [0, 2]}, None, ["id   0: input of layer 0 (the embedding output)",
                             "equivalently: the embedding output, output of layer 1"], []),
    ({"top": [1, 3, 7]}, (6,), ["ids [7] are outside [0, 6]"], []),
    ({"nested": [58, 2, 30]}, None, ["ids [58, 2, 30] are not strictly ascending"], []),
], ids=["top-level", "nested", "target-default", "no-target", "id-zero", "past-target",
        "unsorted"])
def test_show(tmp_path: Path, capsys: pytest.CaptureFixture[str], ids: dict, target,
              present: list[str], absent: list[str]) -> None:
    args = [] if target is None else ["--target", target_dir(tmp_path, *target)]
    # 1: a problem found (ids the engine refuses at start).
    status = int(any("are outside" in s or "not strictly ascending" in s for s in present))
    out = show(capsys, drafter_dir(tmp_path, "d", **ids), *args, status=status)
    assert all(s in out for s in present) and not any(s in out for s in absent), out


def test_show_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = drafter_dir(tmp_path, "d", nested=[1, 3, 6])
    out = show(capsys, d, "--target", target_dir(tmp_path, 6), "--json")
    data = json.loads(out)
    assert data["aux_ids"] == [1, 3, 6] and data["target_layers"] == 6
    assert data["source"] == "nested eagle_config.eagle_aux_hidden_state_layer_ids"
    assert data["captures"][2] == {"id": 6, "input_of_layer": None, "output_of_layer": 5}
    assert data["problems"] == []


def test_show_conflicting_ids_name_both(tmp_path: Path) -> None:
    d = drafter_dir(tmp_path, "d", top=[3, 31, 59], nested=[2, 30, 58])
    msg = refused("show", str(d))
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


def test_show_without_the_series_says_so(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.config.speculative as spec

    monkeypatch.delattr(spec, "get_eagle3_aux_layer_ids", raising=False)
    msg = refused("show", str(drafter_dir(tmp_path, "d", top=[1, 3, 6])))
    assert "no get_eagle3_aux_layer_ids" in msg
    assert "stock vLLM or a build from before the EAGLE-3 series" in msg


def test_convert_in_place_output_of_layer(tmp_path: Path) -> None:
    d = drafter_dir(tmp_path, "d", top=[2, 30, 58], nested=[2, 30, 58])
    before = (d / "config.json").read_bytes()
    proc = run_tool("eagle3_layers", "convert", str(d), "--from", "output-of-layer")
    assert proc.returncode == 0, proc.stderr
    assert (d / "config.json.orig").read_bytes() == before
    new = json.loads((d / "config.json").read_text())
    old = json.loads(before)
    assert new[TOP] == new["eagle_config"][TOP] == [3, 31, 59]
    # The conversion is recorded in the config itself.
    assert new.pop(CONVERTED) == {"from": "output-of-layer", "trained_ids": [2, 30, 58]}
    assert new["eagle_config"]["use_aux_hidden_state"] is True
    # Nothing else changed, and key order is kept.
    for cfg in (new, old):
        cfg.pop(TOP)
        cfg["eagle_config"].pop(TOP)
    assert list(new) == list(old) and new == old
    assert "from [2, 30, 58]" in proc.stdout and "each id + 1" in proc.stdout


@pytest.mark.parametrize("ids, args, top, nested", [
    ({"nested": [2, 30, 58]}, ["output-of-layer"], [3, 31, 59], [3, 31, 59]),
    # input-of-layer makes nested ids explicit at the top level.
    ({"nested": [3, 31, 59]}, ["input-of-layer"], [3, 31, 59], [3, 31, 59]),
    ({"top": [1, 3], "nested_block": False}, ["output-of-layer"], [2, 4], "no block"),
    # speculators 0.4's trainer writes no ids: the user supplies the
    # data-generation ids.
    ({}, ["output-of-layer", "--ids", "2,4,5"], [3, 5, 6], None),
    # Output of layer 6 does not exist in a 6-layer target, input of layer 6 does.
    ({"top": [1, 3, 6]}, ["input-of-layer", "--target", "TARGET"], [1, 3, 6], None),
], ids=["nested-only", "input-of-layer", "no-eagle-config", "ids-given", "inputs-fit-target"])
def test_convert(tmp_path: Path, ids: dict, args: list[str], top, nested) -> None:
    d = drafter_dir(tmp_path, "d", **ids)
    target = str(target_dir(tmp_path, 6))
    eagle3_layers.main(["convert", str(d), "--from", *(target if a == "TARGET" else a
                                                       for a in args)])
    new = json.loads((d / "config.json").read_text())
    assert new[TOP] == top
    if nested == "no block":
        assert "eagle_config" not in new
    else:
        assert new["eagle_config"].get(TOP) == nested


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


def test_convert_refuses_a_second_in_place_conversion(tmp_path: Path) -> None:
    d = drafter_dir(tmp_path, "d", top=[2, 4])
    eagle3_layers.main(["convert", str(d), "--from", "output-of-layer"])
    once = (d / "config.json").read_bytes()
    msg = refused("convert", str(d), "--from", "output-of-layer")
    assert "was converted before" in msg and "twice" in msg and "[2, 4]" in msg
    assert (d / "config.json").read_bytes() == once


@pytest.mark.parametrize("second", ["copy-in-place", "copy-out", "input-of-layer"])
def test_convert_refuses_a_converted_config_whatever_its_name(tmp_path: Path,
                                                               second: str) -> None:
    """A copy made with --out holds no config.json.orig: the record in the
    config itself refuses a second shift ([3, 31, 59] -> [4, 32, 60])."""
    d = drafter_dir(tmp_path, "d", nested=[2, 30, 58])
    out = tmp_path / "converted"
    eagle3_layers.main(["convert", str(d), "--from", "output-of-layer", "--out", str(out)])
    assert json.loads((out / "config.json").read_text())[TOP] == [3, 31, 59]
    before = (out / "config.json").read_bytes()
    args = {"copy-in-place": ["--from", "output-of-layer"],
            "copy-out": ["--from", "output-of-layer", "--out", str(tmp_path / "again")],
            "input-of-layer": ["--from", "input-of-layer"]}[second]
    msg = refused("convert", str(out), *args)
    assert "was converted before" in msg and "shift them twice" in msg, msg
    assert "set the ids back to [2, 30, 58]" in msg
    assert (out / "config.json").read_bytes() == before
    assert not (tmp_path / "again").exists() and not (out / "config.json.orig").exists()


@pytest.mark.parametrize("ids, args, says", [
    ({"top": [3, 31, 59], "nested": [2, 30, 58]}, [],
     ["eagle_aux_hidden_state_layer_ids=[3, 31, 59]",
      "eagle_config.eagle_aux_hidden_state_layer_ids=[2, 30, 58]"]),
    ({}, [], ["sets neither", "--ids"]),
    ({"top": [2, 4]}, ["--ids", "1,4"], ["contradicts"]),
    ({"nested": [58, 2, 30]}, [], ["not ascending", "[58, 2, 30]"]),
    # Output of layer 6 does not exist in a 6-layer target (layers 0..5).
    ({"top": [1, 3, 6]}, ["--target", "TARGET"], ["[7]", "outside [0, 6]"]),
    ({"top": [2, 4]}, ["--out", "TAKEN"], ["must name a new directory"]),
], ids=["conflicting", "no-ids", "contradicting-ids", "unsorted", "past-target", "out-exists"])
def test_convert_refuses(tmp_path: Path, ids: dict, args: list[str], says: list[str]) -> None:
    d = drafter_dir(tmp_path, "d", **ids)
    (tmp_path / "taken").mkdir()
    places = {"TARGET": str(target_dir(tmp_path, 6)), "TAKEN": str(tmp_path / "taken")}
    before = (d / "config.json").read_bytes()
    msg = refused("convert", str(d), "--from", "output-of-layer", *(places.get(a, a) for a in args))
    assert all(s in msg for s in says), msg
    assert (d / "config.json").read_bytes() == before
    assert not (d / "config.json.orig").exists()


def test_convert_requires_the_convention(tmp_path: Path) -> None:
    d = drafter_dir(tmp_path, "d", top=[2, 4])
    proc = run_tool("eagle3_layers", "convert", str(d))
    assert proc.returncode == 2
    assert "--from" in proc.stderr
    assert not (d / "config.json.orig").exists()


def test_convert_cli_error_is_one_line(tmp_path: Path) -> None:
    proc = run_tool("eagle3_layers", "convert", str(tmp_path / "missing"), "--from",
                    "output-of-layer")
    assert proc.returncode == 2  # could not convert
    assert proc.stderr.startswith("python -m tools.eagle3_layers: error: ")
    assert "config.json does not exist" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


@pytest.mark.parametrize("cmd", ["show", "convert"])
def test_malformed_json_names_file_line_and_column(tmp_path: Path, cmd: str) -> None:
    d = drafter_dir(tmp_path, "d", top=[2, 4])
    text = (d / "config.json").read_text().splitlines()
    text[3] += " ,"  # a second comma after the 4th line's value
    (d / "config.json").write_text("\n".join(text) + "\n")
    try:
        json.loads((d / "config.json").read_text())
    except json.JSONDecodeError as e:
        where = f"{d / 'config.json'}:{e.lineno}:{e.colno}: not valid JSON"
    msg = refused(cmd, str(d), *(["--from", "output-of-layer"] if cmd == "convert" else []))
    assert msg.startswith(where), (msg, where)


# Published configs (tests/v1/spec_decode/published_configs: repository, path
# and commit of each in its PROVENANCE.md). SpecForge keeps its ids nested and
# counts layer outputs.

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
    assert new.pop(CONVERTED) == {"from": "output-of-layer", "trained_ids": [1, 29, 57]}
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
