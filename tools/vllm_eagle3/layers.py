"""``show`` (which target layers vLLM feeds an EAGLE-3 drafter) and
``convert`` (a config's ids into vLLM's numbering). Configs only: no device,
no weights.

In vLLM an aux id k is the INPUT of target layer k; SGLang, SpecForge,
TorchSpec and speculators 0.3-0.4 count the OUTPUT of layer k, which is
vLLM's id k + 1 (speculators from 0.5 writes vLLM's ids). A config in their
convention served unchanged feeds the drafter states one layer early, and
nothing fails. ``show`` asks the installed vLLM what it will capture;
``convert`` never guesses the convention (--from), writes the vLLM ids
top-level and into eagle_config where it holds ids, and records the
conversion in the config (``vllm_eagle3_converted``), so that it never
shifts the same config twice.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._base import (CONVERTED, DEFAULT_IDS_TEXT, NESTED, TOP, ToolError, default_aux_ids,
                    provenance, provenance_line, read_config, raw_ids, target_num_layers)


def describe(ids: Sequence[int], n: int | None) -> list[str]:
    """One line per id: the state vLLM captures, and the same state counted as
    a layer output."""
    lines = []
    for k in ids:
        if k == 0:
            pair = ("input of layer 0 (the embedding output)",
                    "no layer's output (the embedding output)")
        elif k == n:
            pair = (f"the final norm's input (no layer {k})",
                    f"output of layer {k - 1}, the last layer")
        else:
            pair = (f"input of layer {k}", f"output of layer {k - 1}")
        lines.append(f"  id {k:>3}: {pair[0]} = {pair[1]}")
    return lines


def series_reader() -> Any:
    """The series' get_eagle3_aux_layer_ids from the installed vLLM."""
    try:
        from vllm.config.speculative import get_eagle3_aux_layer_ids
    except ImportError:
        try:
            import vllm
        except ImportError:
            raise ToolError(
                "vLLM is not installed in this interpreter: run the tool with the "
                "Python of the environment that serves the drafter") from None
        raise ToolError(
            f"the installed vLLM ({getattr(vllm, '__version__', '?')}) has no "
            "get_eagle3_aux_layer_ids: it is stock vLLM or a build from before the EAGLE-3 "
            "series read nested ids, so this tool cannot say what it captures. Install the "
            "series' wheel (vllm-0.16.0+eagle3...) and run show again") from None
    return get_eagle3_aux_layer_ids


def show_data(drafter: Path, target: Path | None) -> dict[str, Any]:
    """What vLLM captures for the drafter: the fields ``show --json`` prints."""
    get_ids = series_reader()
    from vllm.transformers_utils.config import get_config

    drafter = Path(drafter)
    cfg = read_config(drafter, "drafter")  # a malformed file is named with line and column
    n = target_num_layers(target) if target is not None else None
    hf_config = get_config(str(drafter), trust_remote_code=False)
    try:
        got = get_ids(hf_config)
    except ValueError as e:
        raise ToolError(f"vLLM refuses the drafter's ids: {e}") from None
    data: dict[str, Any] = {
        "drafter": str(drafter), "architectures": getattr(hf_config, "architectures", None),
        "target": None if target is None else str(target), "target_layers": n,
        "aux_ids": None, "source": None, "provenance": provenance(cfg, drafter),
        "captures": [], "problems": []}
    if got is not None:
        ids, key = tuple(got[0]), got[1]
        data["source"] = ("nested " if key == NESTED else "top-level ") + key
    elif n is None:
        data["source"] = "none in the drafter's config"
        return data
    else:
        ids = default_aux_ids(n)
        data["source"] = (f"target default {DEFAULT_IDS_TEXT} with n = {n}: neither {TOP} "
                          f"nor {NESTED} is set")
    data["aux_ids"] = list(ids)
    data["captures"] = [{"id": k, "input_of_layer": None if k == n else k,
                         "output_of_layer": None if k == 0 else k - 1} for k in ids]
    if n is not None and (bad := [k for k in ids if not 0 <= k <= n]):
        data["problems"].append(
            f"ids {bad} are outside [0, {n}]: the engine refuses them at start")
    if list(ids) != sorted(set(ids)):
        data["problems"].append(
            f"ids {list(ids)} are not strictly ascending: the engine refuses them at "
            "start (the states come back in layer order, so fc would get them permuted)")
    return data


def show_lines(data: dict[str, Any]) -> list[str]:
    n, ids = data["target_layers"], data["aux_ids"]
    out = [f"drafter: {data['drafter']} (architectures: {data['architectures']})"]
    if n is not None:
        out.append(f"target: {data['target']}, {n} layers: ids 0..{n} are valid "
                   f"(0 = embedding output, {n} = last layer's output before the final norm)")
    if ids is None:
        return out + ["aux ids: none in the drafter's config; vLLM uses the target model's "
                      f"default {DEFAULT_IDS_TEXT}: pass --target to see it",
                      provenance_line(data["provenance"])]
    out.append(f"aux ids: {ids}  (source: {data['source']})")
    out.append("vLLM captures: " + ", ".join(
        "the final norm's input" if k == n else f"input of layer {k}" for k in ids))
    out.append("  equivalently: " + ", ".join(
        "the embedding output" if k == 0 else f"output of layer {k - 1}" for k in ids))
    out.extend(describe(ids, n))
    out.extend(data["problems"])
    prov = data["provenance"]
    out.append(provenance_line(prov))
    if prov is None or prov["numbering"] != "input-of-layer":
        out.append("A drafter trained on the output of layer k (SGLang, SpecForge, TorchSpec, "
                   "speculators 0.3-0.4) needs vLLM id k + 1: see `convert --from "
                   "output-of-layer`.")
    return out


def show(drafter: Path, target: Path | None) -> list[str]:
    return show_lines(show_data(drafter, target))


def converted_ids(config_ids: dict[str, tuple[int, ...]], given: tuple[int, ...] | None,
                  convention: str, n: int | None,
                  where: Path) -> tuple[tuple[int, ...], tuple[int, ...], str]:
    """(ids as trained, vLLM ids, where the trained ids came from)."""
    values = set(config_ids.values())
    if len(values) > 1:
        raise ToolError(
            f"{where} holds two different id lists, {TOP}={list(config_ids[TOP])} and "
            f"{NESTED}={list(config_ids[NESTED])}: find out which one the drafter was trained "
            "with, delete the other, and convert again")
    have = next(iter(values), None)
    if given is not None and have is not None and have != given:
        raise ToolError(
            f"--ids {','.join(map(str, given))} contradicts {where}, which holds "
            f"{list(have)} ({' and '.join(config_ids)}): drop --ids, or fix the config")
    if given is not None:
        trained, origin = given, "--ids"
    elif have is not None:
        trained, origin = have, " and ".join(config_ids)
    else:
        raise ToolError(
            f"{where} sets neither {TOP} nor {NESTED}: nothing to convert. Pass the layer ids "
            "the drafter was trained on with --ids (for speculators 0.3-0.4's data "
            "generation: the --layer-ids it ran with, less the last one, which feeds the "
            "verifier's logits, not the drafter)")
    if any(k < 0 for k in trained):
        raise ToolError(f"negative layer id in {list(trained)} ({origin})")
    if len(set(trained)) != len(trained):
        raise ToolError(f"repeated layer id in {list(trained)} ({origin})")
    if list(trained) != sorted(trained):
        raise ToolError(
            f"the ids {list(trained)} ({origin}) are not ascending: vLLM returns the states in "
            "layer order, so the drafter's fc would get permuted features. Sorting them "
            "would not help (fc was trained in this order); this drafter cannot be served as is")
    shift = 1 if convention == "output-of-layer" else 0
    vllm_ids = tuple(k + shift for k in trained)
    if n is not None and (bad := [k for k in vllm_ids if not 0 <= k <= n]):
        raise ToolError(
            f"vLLM ids {list(vllm_ids)} (from {list(trained)} as {convention}) include "
            f"{bad}, outside [0, {n}] for the {n}-layer target: is --from right, and is "
            "--target the model the drafter was trained for?")
    return trained, vllm_ids, origin


def write_ids_copy(drafter: Path, ids: Sequence[int], out: Path) -> Path:
    """A copy of the drafter at ``out`` (weights hard-linked) whose config
    holds ``ids`` as vLLM ids, top level and nested where the source has
    nested ids: what calibrate serves to measure one reading."""
    drafter, out = Path(drafter), Path(out)
    cfg = read_config(drafter, "drafter")
    new = {**cfg, TOP: list(ids)}
    nested = cfg.get("eagle_config")
    if isinstance(nested, dict) and TOP in nested:
        new["eagle_config"] = {**nested, TOP: list(ids)}
    copy_checkpoint(drafter, out)
    _write_json_atomic(out / "config.json", new, like=drafter / "config.json")
    return out


def _write_json_atomic(path: Path, obj: dict[str, Any], like: Path) -> None:
    """``obj`` as ``path``, with the permission bits of ``like`` (the config
    it replaces: a server running as another user reads it as before).
    A new file renamed over the old one: never writes through a hard link
    that --out made to the source's config.json, nor through a symlink into
    a Hugging Face cache's blobs."""
    mode = stat.S_IMODE(Path(like).stat().st_mode)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".config.", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(obj, indent=2) + "\n")
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _link_or_copy(src: str, dst: str) -> str:
    """``dst`` holds ``src``'s bytes: a hard link to the file ``src``
    resolves to (a Hugging Face snapshot's files are relative symlinks into
    ../../blobs, which would point nowhere from ``dst``), or a copy with
    its permission bits where the filesystem cannot link (another device)."""
    real = os.path.realpath(src)
    try:
        os.link(real, dst)
    except OSError:
        shutil.copy2(real, dst)
    return dst


def copy_checkpoint(drafter: Path, out: Path) -> None:
    """A copy of the checkpoint directory with real files: symlinks (to
    files or directories) are followed, files hard-linked where possible."""
    shutil.copytree(drafter, out, copy_function=_link_or_copy, symlinks=False)


def convert(drafter: Path, convention: str, *, out: Path | None = None,
            target: Path | None = None, ids: tuple[int, ...] | None = None) -> list[str]:
    return convert_data(drafter, convention, out=out, target=target, ids=ids)["lines"]


def convert_data(drafter: Path, convention: str, *, out: Path | None = None,
                 target: Path | None = None, ids: tuple[int, ...] | None = None
                 ) -> dict[str, Any]:
    """Convert; what ``convert --json`` prints, with the lines under "lines"."""
    drafter = Path(drafter)
    config_path = drafter / "config.json"
    cfg = read_config(drafter, "drafter")
    backup = drafter / "config.json.orig"
    if isinstance(done := cfg.get(CONVERTED), dict):
        raise ToolError(
            f"{config_path} was converted before ({CONVERTED}: from {done.get('from')}, "
            f"trained ids {done.get('trained_ids')}): its ids are vLLM's already, and "
            "converting again would shift them twice. To redo the conversion, "
            + (f"put the original back (`mv {backup} {config_path}`), then convert again"
               if backup.exists() else
               f"set the ids back to {done.get('trained_ids')}, delete {CONVERTED}, then "
               "convert again"))
    prov = provenance(cfg, drafter)
    if prov is not None and prov["numbering"] not in (None, convention):
        raise ToolError(
            f"{config_path}: {prov['field']} says the ids are numbered {prov['numbering']} "
            f"({prov['why']}), not {convention} as --from says: "
            + ("they are vLLM's already, and converting would shift them twice; serve it "
               "as is" if prov["numbering"] == "input-of-layer" else
               "convert with --from output-of-layer"))
    n = target_num_layers(target) if target is not None else None
    trained, vllm_ids, origin = converted_ids(raw_ids(cfg, config_path), ids, convention, n,
                                              config_path)
    new = {**cfg, TOP: list(vllm_ids),
           CONVERTED: {"from": convention, "trained_ids": list(trained)}}
    nested = cfg.get("eagle_config")
    if nested_too := isinstance(nested, dict) and TOP in nested:
        new["eagle_config"] = {**nested, TOP: list(vllm_ids)}
    if out is None:
        if backup.exists():
            raise ToolError(
                f"{backup} exists: this drafter was converted before, and converting again "
                f"would shift the ids twice. To redo it from the original, `mv {backup} "
                f"{config_path}`, then convert again; if {config_path} is the original, "
                f"delete {backup}, or convert with --out DIR")
        shutil.copy2(config_path, backup)
        dest, kept = config_path, f"original kept as {backup}"
    else:
        out = Path(out)
        if out.exists():
            raise ToolError(f"{out} exists: --out must name a new directory")
        if out.resolve().is_relative_to(drafter.resolve()):
            raise ToolError(f"--out {out} is inside the drafter directory {drafter}")
        copy_checkpoint(drafter, out)
        dest, kept = out / "config.json", f"{drafter} unchanged"
    _write_json_atomic(dest, new, like=config_path)
    lines = [
        f"{dest}: {TOP} = {list(vllm_ids)}" + (" (and in eagle_config)" if nested_too else ""),
        f"  from {list(trained)} ({origin}) counted as {convention}"
        + (": each id + 1" if convention == "output-of-layer" else ": unchanged"),
        f"  vLLM captures the inputs of layers {list(vllm_ids)} = outputs of layers "
        f"{[k - 1 for k in vllm_ids]}; {kept}",
        "  " + provenance_line(prov),
    ]
    return {"config": str(dest), "aux_ids": list(vllm_ids), "trained_ids": list(trained),
            "trained_ids_from": origin, "from": convention, "nested_too": nested_too,
            "original": str(drafter / "config.json.orig") if out is None else str(drafter),
            "provenance": prov, "lines": lines}



def set_ids_in_place(drafter: Path, ids: Sequence[int], *, how: str) -> list[str]:
    """Write ``ids`` as the drafter's vLLM ids (top level, and nested where
    the config holds nested ids), keeping config.json.orig and recording the
    change as convert does: calibrate --write for a --candidates winner."""
    drafter = Path(drafter)
    config_path = drafter / "config.json"
    cfg = read_config(drafter, "drafter")
    backup = drafter / "config.json.orig"
    if isinstance(cfg.get(CONVERTED), dict) or backup.exists():
        raise ToolError(f"{config_path} was converted before ({CONVERTED} or {backup}): "
                        f"put the original back (`mv {backup} {config_path}`), then run "
                        "this again")
    before = sorted(set(raw_ids(cfg, config_path).values()))
    new = {**cfg, TOP: list(ids),
           CONVERTED: {"from": how, "trained_ids": list(before[0]) if before else None}}
    nested = cfg.get("eagle_config")
    if isinstance(nested, dict) and TOP in nested:
        new["eagle_config"] = {**nested, TOP: list(ids)}
    shutil.copy2(config_path, backup)
    _write_json_atomic(config_path, new, like=config_path)
    return [f"{config_path}: {TOP} = {list(ids)} ({how}); original kept as {backup}"]
