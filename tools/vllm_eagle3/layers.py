"""Which target layers an EAGLE-3 drafter is fed, whether it fits its target,
and a converter between layer-numbering conventions.

    python -m tools.eagle3_layers show DRAFTER_DIR [--target TARGET_DIR]
    python -m tools.eagle3_layers check DRAFTER_DIR --target TARGET_DIR
    python -m tools.eagle3_layers calibrate DRAFTER_DIR --target TARGET_DIR [--prompts FILE]
                                  [--write] [--via auto|replay|spec-decode]
    python -m tools.eagle3_layers convert DRAFTER_DIR --from output-of-layer|input-of-layer
                                  [--ids K,K,K] [--target TARGET_DIR] [--out DIR]

``check`` reads both configs through vLLM and the drafter's safetensors
headers (never the weights) and prints one line per check, ``FAIL  <problem>;
fix: <fix>`` for each problem; exit 1 when there is one (tools/eagle3_fit.py).

``calibrate`` measures greedy acceptance (k = 3) of the drafter under both
readings of its ids: input-of-layer (vLLM ids = the ids) and output-of-layer
(ids + 1), prints the mean acceptance length and the per-position acceptance
of each and ends with ``verdict: input-of-layer|output-of-layer|undetermined``.
Margin rule: a reading wins when its mean acceptance length beats the other's
by at least 0.05 and by three standard errors of the difference (from the
per-draft accepted counts); a reading that needs an id past the last layer
is scored as a drafter that never hits. ``--write`` writes the winner's ids
top-level as ``convert`` does; it refuses an undetermined verdict. Two ways
to measure, both through vLLM's own engine and drafter class:

- ``spec-decode`` (default off CPU): serve the target with the drafter, once
  per reading (a converted copy), and read the engine's spec-decode counters.
- ``replay`` (default on CPU, and the tested path): vLLM 0.16's CPU runner
  refuses speculative decoding, so one CPU engine run of the target captures
  the layers of both readings (the model's ``set_aux_hidden_state_layers``,
  as the GPU runner calls it), then the EAGLE proposer's ``load_model`` loads
  the drafter and its own forward, ``combine_hidden_states`` and
  ``compute_logits`` replay the engine's greedy loop: draft k tokens from the
  last accepted row, keep the leading ones the target's greedy continuation
  agrees with, add the target's token, repeat. Only the paged attention
  kernel is replaced, by causal softmax attention over the same q/k/v (the
  kernel needs a scheduled step's KV cache and metadata); rows are recomputed
  each step, which is what the KV cache would hold.

In vLLM an aux id k is the INPUT of target layer k; SGLang, SpecForge and
speculators' data generation count the OUTPUT of layer k, which is vLLM's id
k + 1. A config in their convention served unchanged feeds the drafter states
one layer early, and nothing fails (README.md, "Which target layers a drafter
gets"). ``show`` asks the installed vLLM what it will capture; ``convert``
never guesses the convention (--from) and writes the vLLM ids top-level and
into eagle_config where it holds ids, keeping config.json.orig (in place) or
the source directory (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tools._common import REPO_ROOT, StackError, parser, run_main

TOOL = "eagle3-layers"
TOP = "eagle_aux_hidden_state_layer_ids"
NESTED = "eagle_config.eagle_aux_hidden_state_layer_ids"


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise StackError(f"{path} does not exist: pass a checkpoint directory holding config.json")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise StackError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise StackError(f"{path} holds a {type(data).__name__}, not a JSON object")
    return data


def target_num_layers(target_dir: Path) -> int:
    """num_hidden_layers of the target's text model (top level, or text_config
    for multimodal wrappers such as Kimi-K2.5)."""
    cfg = _read_json(Path(target_dir) / "config.json")
    for holder in (cfg, cfg.get("text_config")):
        if isinstance(holder, dict) and isinstance(holder.get("num_hidden_layers"), int):
            return int(holder["num_hidden_layers"])
    raise StackError(
        f"{target_dir}/config.json has no integer num_hidden_layers (top level or "
        "text_config): is --target the target model's checkpoint directory?")


def raw_ids(cfg: dict[str, Any], config_path: Path) -> dict[str, tuple[int, ...]]:
    """The ids config.json holds, by place (only the places that are set)."""
    nested = cfg.get("eagle_config")
    found = {TOP: cfg.get(TOP), NESTED: nested.get(TOP) if isinstance(nested, dict) else None}
    for where, value in found.items():
        if value is not None and not (isinstance(value, list) and all(
                isinstance(k, int) and not isinstance(k, bool) for k in value)):
            raise StackError(f"{config_path}: {where} must be a list of integers, got {value!r}")
    return {where: tuple(value) for where, value in found.items() if value is not None}


def _series_reader() -> Any:
    # `python -m tools...` puts the repo root first on sys.path, where vllm/ may
    # be the unpatched upstream source tree: the installed vLLM is what serves.
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO_ROOT]
    try:
        from vllm.config.speculative import get_eagle3_aux_layer_ids
    except ImportError:
        try:
            import vllm
        except ImportError:
            raise StackError(
                "vLLM is not installed in this interpreter: run the tool with the "
                "Python of the environment that serves the drafter") from None
        raise StackError(
            f"the installed vLLM ({getattr(vllm, '__version__', '?')}) has no "
            "get_eagle3_aux_layer_ids: it is stock vLLM or a build from before the EAGLE-3 "
            "series read nested ids, so this tool cannot say what it captures. Install the "
            "current series' wheel (./build.sh) and run show again") from None
    return get_eagle3_aux_layer_ids


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


def show(drafter: Path, target: Path | None) -> list[str]:
    get_ids = _series_reader()
    from vllm.transformers_utils.config import get_config

    drafter = Path(drafter)
    if not (drafter / "config.json").is_file():
        raise StackError(f"{drafter}/config.json does not exist: pass the drafter's directory")
    n = target_num_layers(target) if target is not None else None
    hf_config = get_config(str(drafter), trust_remote_code=False)
    try:
        got = get_ids(hf_config)
    except ValueError as e:
        raise StackError(f"vLLM refuses the drafter's ids: {e}") from None
    out = [f"drafter: {drafter} (architectures: {getattr(hf_config, 'architectures', None)})"]
    if n is not None:
        out.append(f"target: {target}, {n} layers: ids 0..{n} are valid "
                   f"(0 = embedding output, {n} = last layer's output before the final norm)")
    if got is not None:
        ids, key = tuple(got[0]), got[1]
        source = ("nested " if key == NESTED else "top-level ") + key
    elif n is None:
        return out + ["aux ids: none in the drafter's config; vLLM uses the target model's "
                      "default (2, n//2, n-3): pass --target to see it"]
    else:
        ids = (2, n // 2, n - 3)
        source = f"target default (2, n//2, n-3) with n = {n}: neither {TOP} nor {NESTED} is set"
    out.append(f"aux ids: {list(ids)}  (source: {source})")
    out.append("vLLM captures: " + ", ".join(
        "the final norm's input" if k == n else f"input of layer {k}" for k in ids))
    out.append("  equivalently: " + ", ".join(
        "the embedding output" if k == 0 else f"output of layer {k - 1}" for k in ids))
    out.extend(describe(ids, n))
    if n is not None and (bad := [k for k in ids if not 0 <= k <= n]):
        out.append(f"ids {bad} are outside [0, {n}]: the engine refuses them at start")
    if list(ids) != sorted(set(ids)):
        out.append(f"ids {list(ids)} are not strictly ascending: the engine refuses them at "
                   "start (the states come back in layer order, so fc would get them permuted)")
    out.append("A drafter trained on the output of layer k (SGLang, SpecForge, speculators "
               "data generation) needs vLLM id k + 1: see `convert --from output-of-layer`.")
    return out


def _parse_ids(text: str) -> tuple[int, ...]:
    try:
        ids = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ids takes integers separated by commas, got {text!r}")
    if not ids:
        raise argparse.ArgumentTypeError("--ids is empty")
    return ids


def converted_ids(config_ids: dict[str, tuple[int, ...]], given: tuple[int, ...] | None,
                  convention: str, n: int | None,
                  where: Path) -> tuple[tuple[int, ...], tuple[int, ...], str]:
    """(ids as trained, vLLM ids, where the trained ids came from)."""
    values = set(config_ids.values())
    if len(values) > 1:
        raise StackError(
            f"{where} holds two different id lists, {TOP}={list(config_ids[TOP])} and "
            f"{NESTED}={list(config_ids[NESTED])}: find out which one the drafter was trained "
            "with, delete the other, and convert again")
    have = next(iter(values), None)
    if given is not None and have is not None and have != given:
        raise StackError(
            f"--ids {','.join(map(str, given))} contradicts {where}, which holds "
            f"{list(have)} ({' and '.join(config_ids)}): drop --ids, or fix the config")
    if given is not None:
        trained, origin = given, "--ids"
    elif have is not None:
        trained, origin = have, " and ".join(config_ids)
    else:
        raise StackError(
            f"{where} sets neither {TOP} nor {NESTED}: nothing to convert. Pass the layer ids "
            "the drafter was trained on with --ids (for speculators' data generation: the "
            "--layer-ids it ran with, less the last one, which feeds the verifier's "
            "logits, not the drafter)")
    if any(k < 0 for k in trained):
        raise StackError(f"negative layer id in {list(trained)} ({origin})")
    if len(set(trained)) != len(trained):
        raise StackError(f"repeated layer id in {list(trained)} ({origin})")
    if list(trained) != sorted(trained):
        raise StackError(
            f"the ids {list(trained)} ({origin}) are not ascending: vLLM returns the states in "
            "layer order, so the drafter's fc would get permuted features. Sorting them "
            "would not help (fc was trained in this order); this drafter cannot be served as is")
    shift = 1 if convention == "output-of-layer" else 0
    vllm_ids = tuple(k + shift for k in trained)
    if n is not None and (bad := [k for k in vllm_ids if not 0 <= k <= n]):
        raise StackError(
            f"vLLM ids {list(vllm_ids)} (from {list(trained)} as {convention}) include "
            f"{bad}, outside [0, {n}] for the {n}-layer target: is --from right, and is "
            "--target the model the drafter was trained for?")
    return trained, vllm_ids, origin


def _write_json_atomic(path: Path, obj: dict[str, Any]) -> None:
    # A new file renamed over the old one: never writes through a hard link
    # that --out made to the source's config.json.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".config.", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(obj, indent=2) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _link_or_copy(src: str, dst: str) -> str:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst


def convert(drafter: Path, convention: str, *, out: Path | None = None,
            target: Path | None = None, ids: tuple[int, ...] | None = None) -> list[str]:
    drafter = Path(drafter)
    config_path = drafter / "config.json"
    cfg = _read_json(config_path)
    n = target_num_layers(target) if target is not None else None
    trained, vllm_ids, origin = converted_ids(raw_ids(cfg, config_path), ids, convention, n,
                                              config_path)
    new = {**cfg, TOP: list(vllm_ids)}
    nested = cfg.get("eagle_config")
    if nested_too := isinstance(nested, dict) and TOP in nested:
        new["eagle_config"] = {**nested, TOP: list(vllm_ids)}
    if out is None:
        backup = drafter / "config.json.orig"
        if backup.exists():
            raise StackError(
                f"{backup} exists: this drafter was converted before. Converting again would "
                "shift the ids twice; restore config.json from it first if that is what you want")
        shutil.copy2(config_path, backup)
        dest, kept = config_path, f"original kept as {backup}"
    else:
        out = Path(out)
        if out.exists():
            raise StackError(f"{out} exists: --out must name a new directory")
        if out.resolve().is_relative_to(drafter.resolve()):
            raise StackError(f"--out {out} is inside the drafter directory {drafter}")
        shutil.copytree(drafter, out, copy_function=_link_or_copy, symlinks=True)
        dest, kept = out / "config.json", f"{drafter} unchanged"
    _write_json_atomic(dest, new)
    return [
        f"{dest}: {TOP} = {list(vllm_ids)}" + (" (and in eagle_config)" if nested_too else ""),
        f"  from {list(trained)} ({origin}) counted as {convention}"
        + (": each id + 1" if convention == "output-of-layer" else ": unchanged"),
        f"  vLLM captures the inputs of layers {list(vllm_ids)} = outputs of layers "
        f"{[k - 1 for k in vllm_ids]}; {kept}",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser("eagle3_layers", __doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("show", help="print the target layers vLLM feeds the drafter")
    sp.add_argument("drafter", type=Path, metavar="DRAFTER_DIR")
    sp.add_argument("--target", type=Path, metavar="TARGET_DIR",
                    help="the target checkpoint: gives n for the default ids and the range check")
    cp = sub.add_parser("convert", help="write the ids in vLLM's numbering into config.json")
    cp.add_argument("drafter", type=Path, metavar="DRAFTER_DIR")
    cp.add_argument("--from", dest="convention", required=True,
                    choices=("output-of-layer", "input-of-layer"),
                    help="how the config's ids count: output-of-layer (SGLang, SpecForge, "
                         "speculators) or input-of-layer (vLLM)")
    cp.add_argument("--ids", type=_parse_ids, metavar="K,K,K",
                    help="the ids the drafter was trained on, for a config that has none")
    cp.add_argument("--target", type=Path, metavar="TARGET_DIR",
                    help="refuse ids outside [0, n] for this target")
    cp.add_argument("--out", type=Path, metavar="DIR",
                    help="write a converted copy here instead of converting in place")
    kp = sub.add_parser("check", help="preflight: does the drafter fit the target? "
                                      "(configs and safetensors headers only)")
    kp.add_argument("drafter", type=Path, metavar="DRAFTER_DIR")
    kp.add_argument("--target", type=Path, metavar="TARGET_DIR", required=True)
    kp.add_argument("--trust-remote-code", action="store_true")
    lp = sub.add_parser("calibrate", help="measure which numbering the drafter was trained "
                                          "in: acceptance under both readings")
    lp.add_argument("drafter", type=Path, metavar="DRAFTER_DIR")
    lp.add_argument("--target", type=Path, metavar="TARGET_DIR", required=True)
    lp.add_argument("--prompts", type=Path, metavar="FILE",
                    help="one prompt a line (default: a built-in set of 8)")
    lp.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt")
    lp.add_argument("--write", action="store_true",
                    help="write the winning ids top-level, as convert does (in place, "
                         "config.json.orig kept)")
    lp.add_argument("--via", choices=("auto", "replay", "spec-decode"), default="auto",
                    help="auto: replay on a CPU build, spec-decode otherwise")
    lp.add_argument("--tensor-parallel-size", type=int, default=1)
    lp.add_argument("--enforce-eager", action="store_true",
                    help="spec-decode: no torch.compile or CUDA graphs (faster start)")
    lp.add_argument("--trust-remote-code", action="store_true")
    args = ap.parse_args(argv)
    if args.cmd in ("check", "calibrate"):
        # vLLM's log lines would bury the report; its errors still raise.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        _series_reader()
    if args.cmd == "calibrate":
        from tools.eagle3_fit import calibrate

        engine_args = {"tensor_parallel_size": args.tensor_parallel_size,
                       "trust_remote_code": args.trust_remote_code}
        if args.enforce_eager:
            engine_args["enforce_eager"] = True
        lines, _ = calibrate(args.drafter, args.target, prompts=args.prompts,
                             max_tokens=args.max_tokens, write=args.write, via=args.via,
                             engine_args=engine_args)
        print("\n".join(lines))
        return 0
    if args.cmd == "check":
        from tools.eagle3_fit import check

        lines, problems = check(args.drafter, args.target, args.trust_remote_code)
        print("\n".join(lines))
        return 1 if problems else 0
    print("\n".join(show(args.drafter, args.target) if args.cmd == "show" else
                    convert(args.drafter, args.convention, out=args.out, target=args.target,
                            ids=args.ids)))
    return 0


if __name__ == "__main__":
    run_main(TOOL, main)
