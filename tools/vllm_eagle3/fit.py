"""Does an EAGLE-3 drafter fit its target? ``check`` (configs and safetensors
headers, never the weights, no device needed) and ``calibrate`` (measured
acceptance under each reading of the drafter's layer ids).

Everything is asked of the installed vLLM where it can be: the drafter config
is read by ``SpeculativeConfig``, the class by ``ModelRegistry``, and which
tensors the class loads by building it on the meta device and running its own
``load_weights`` over meta tensors of the header's shapes.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ._base import (DEEPSEEK_FAMILY, DEFAULT_IDS_TEXT, NESTED, TOP, ToolError,
                    default_aux_ids, device_problem, provenance, provenance_line, read_config,
                    read_json)
from .layers import convert, set_ids_in_place, write_ids_copy

# safetensors' dtype names (the header's "dtype" field).
ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
             "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64",
             "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
FLOATS = {"float64", "float32", "float16", "bfloat16"}
# Drafter tensors the proposer may take from elsewhere (vLLM v0.16.0
# eagle.py load_model: _maybe_share_embeddings / _maybe_share_lm_head share the
# target's when the checkpoint has none), or that default correctly when
# absent (draft_id_to_target_id: zeros = identity, right when the draft
# vocabulary is the target's; the vocabulary check covers the other case).
SHARED_OR_DEFAULT = ("model.embed_tokens.weight", "lm_head.weight", "draft_id_to_target_id")


class Weights:
    """What a checkpoint's weight files declare, read as vLLM's default
    loader picks them: *.safetensors (their index's files if there is one),
    else pytorch_model*.bin (likewise). ``headers``: {tensor name: (shape,
    dtype)}; ``problems``: (message, fix, tensor names it explains) per file
    that is missing or unreadable; ``kind``: "safetensors", "bin" or None
    (no weight files)."""

    def __init__(self, directory: Path) -> None:
        self.headers: dict[str, tuple[tuple[int, ...], str]] = {}
        self.problems: list[tuple[str, str, list[str]]] = []
        self.kind: str | None = None
        for kind, index_name, pattern in (
                ("safetensors", "model.safetensors.index.json", "*.safetensors"),
                ("bin", "pytorch_model.bin.index.json", "*.bin")):
            index = directory / index_name
            if index.is_file():
                weight_map = read_json(index).get("weight_map")
                if not isinstance(weight_map, dict):
                    raise ToolError(f"{index} has no weight_map object: download it again")
                by_file: dict[str, list[str]] = {}
                for tensor, name in weight_map.items():
                    by_file.setdefault(str(name), []).append(tensor)
                self.kind = kind
                self._read(directory, by_file, index)
                return
            files = sorted(p.name for p in directory.glob(pattern))
            if files:
                self.kind = kind
                self._read(directory, {f: [] for f in files}, None)
                return

    def _read(self, directory: Path, by_file: dict[str, list[str]], index: Path | None) -> None:
        for name, tensors in sorted(by_file.items()):
            path = directory / name
            if path.is_symlink() and not path.exists():
                self.problems.append((
                    f"{path} is a symlink to {os.readlink(path)}, which does not exist",
                    "download the file again (a Hugging Face cache whose blob was deleted "
                    "or never finished: `huggingface-cli download` the repo)", tensors))
            elif not path.is_file():
                self.problems.append((
                    f"{name}, which {index.name if index else 'the checkpoint'} lists, is "
                    f"missing from {directory}",
                    "download every file the index lists (`huggingface-cli download` the "
                    "repo, or copy the missing shard)", tensors))
            else:
                try:
                    self.headers.update(self._one(path))
                except Exception as e:  # each reader raises its own error types
                    what = "safetensors" if self.kind == "safetensors" else "PyTorch"
                    self.problems.append((
                        f"{path}: not a readable {what} file "
                        f"({' '.join(str(e).split())[:200]})",
                        "download it again (a download cut short?)", tensors))

    def _one(self, path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
        out: dict[str, tuple[tuple[int, ...], str]] = {}
        if self.kind == "safetensors":
            # safe_open reads the header and maps the file: no tensor data.
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    part = f.get_slice(key)
                    out[key] = (tuple(part.get_shape()),
                                ST_DTYPES.get(part.get_dtype(), part.get_dtype()))
            return out
        # A PyTorch pickle: mapped, onto the meta device (shapes and dtypes
        # only); weights_only, as vLLM's loader reads it.
        import torch

        try:
            state = torch.load(path, map_location="meta", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            # the legacy (pre-zipfile) format cannot be mapped
            state = torch.load(path, map_location="meta", weights_only=True)
        if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
            state = state["state_dict"]
        if not isinstance(state, dict):
            raise ToolError(f"{path} holds a {type(state).__name__}, not a state dict")
        for key, t in state.items():
            if isinstance(t, torch.Tensor):
                out[str(key)] = (tuple(t.shape), str(t.dtype).removeprefix("torch."))
        return out


def read_headers(directory: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """{tensor name: (shape, dtype)} of the checkpoint's weights (Weights)."""
    return Weights(Path(directory)).headers


def _ckpt_key(name: str) -> str:
    """A checkpoint name as the drafter classes map it (model. dropped,
    midlayer. = layers.0.)."""
    name = name.removeprefix("model.")
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


# Checkpoint tensors that vLLM's layers stack into one parameter.
FUSED = ((".q_proj.", ".qkv_proj."), (".k_proj.", ".qkv_proj."), (".v_proj.", ".qkv_proj."),
         (".gate_proj.", ".gate_up_proj."), (".up_proj.", ".gate_up_proj."),
         (".q_a_proj.", ".fused_qkv_a_proj."), (".kv_a_proj_with_mqa.", ".fused_qkv_a_proj."))


def _param_key(name: str) -> str:
    """A checkpoint or parameter name as the parameter it loads into."""
    key = _ckpt_key(name)
    for part, fused in FUSED:
        key = key.replace(part, fused)
    return key


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """gloo prints a line per process group on file descriptor 1, into the report."""
    sys.stdout.flush()
    saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


@contextlib.contextmanager
def _one_process_world() -> Iterator[None]:
    """vLLM's parallel layers need a tensor-parallel group: a gloo world of one."""
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as tmp:
        with _quiet_stdout():
            ps.init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                            backend="gloo",
                                            distributed_init_method=f"file://{tmp}/init")
            ps.ensure_model_parallel_initialized(1, 1)
        try:
            yield
        finally:
            ps.destroy_model_parallel()
            ps.destroy_distributed_environment()


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def one_line(e: Exception) -> str:
    """vLLM's own sentence from an exception, in one line: pydantic's
    wrapping (the field list, input_value, the errors URL) dropped."""
    text = str(e)
    if "Value error, " in text:
        text = text.split("Value error, ", 1)[1].split(" [type=", 1)[0]
    if "trust_remote_code=True" in text:
        return ("its config is custom code (auto_map): pass --trust-remote-code, as "
                "`vllm serve` needs it")
    return " ".join(text.split())


@contextlib.contextmanager
def _no_hub_lookup_for_a_directory() -> Iterator[None]:
    """vLLM 0.16.0 looks up the weights' dtype on the Hugging Face hub when a
    config names none (model_arch_config_convertor: try_get_safetensors_
    metadata), also for a local directory, which the hub refuses after two
    retries and four ERROR lines (about 6 s). A directory's answer is none
    either way: say so at once."""
    from vllm.transformers_utils import model_arch_config_convertor as conv

    original = conv.try_get_safetensors_metadata

    def lookup(model: str, *args: Any, **kwargs: Any) -> Any:
        return None if Path(str(model)).is_dir() else original(model, *args, **kwargs)

    conv.try_get_safetensors_metadata = lookup
    try:
        yield
    finally:
        conv.try_get_safetensors_metadata = original


def configs(drafter: Path, target: Path, trust_remote_code: bool = False) -> tuple[Any, Any]:
    """(target ModelConfig, SpeculativeConfig) as the engine builds them."""
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig

    try:
        with _no_hub_lookup_for_a_directory():
            tcfg = ModelConfig(model=str(target), tokenizer=str(target),
                               skip_tokenizer_init=True, dtype="auto",
                               trust_remote_code=trust_remote_code)
    except Exception as e:
        raise ToolError(f"vLLM cannot read the target config {target}: {one_line(e)}") from None
    try:
        with _no_hub_lookup_for_a_directory():
            spec = SpeculativeConfig(method="eagle3", model=str(drafter),
                                     num_speculative_tokens=3, target_model_config=tcfg,
                                     target_parallel_config=ParallelConfig())
    except Exception as e:
        raise ToolError(f"vLLM refuses the drafter config {drafter}: {one_line(e)}") from None
    return tcfg, spec


@contextlib.contextmanager
def _engine_id_check_reported(drafter: Path, target: Path, trust_remote_code: bool,
                              refusals: list[str]) -> Iterator[None]:
    """The series refuses bad aux ids while SpeculativeConfig is built
    (``_verify_eagle3_draft``). If it refuses this pair, its message goes to
    ``refusals`` and the check is skipped inside the block, so that ``check``
    still names every problem of the pair, one line each."""
    from unittest import mock

    from vllm.config import SpeculativeConfig

    verify = getattr(SpeculativeConfig, "_verify_eagle3_draft", None)
    if verify is None:  # stock v0.16.0 has no such check
        yield
        return
    try:
        configs(drafter, target, trust_remote_code)
    except ToolError as e:
        with mock.patch.object(SpeculativeConfig, "_verify_eagle3_draft", lambda self: None):
            try:
                configs(drafter, target, trust_remote_code)
            except ToolError:
                yield  # refused for another reason: _check reports it as before
                return
            msg = str(e).split(": ", 1)[-1]
            # pydantic wraps the ValueError: keep vLLM's own sentence.
            msg = msg.split("Value error, ", 1)[-1].split(" [type=", 1)[0]
            refusals.append(msg)
            yield
        return
    yield


def engine_ids(hf: Any, n: int) -> tuple[tuple[int, ...], str]:
    """The ids the engine captures for this draft config, and where from."""
    from vllm.config.speculative import get_eagle3_aux_layer_ids

    found = get_eagle3_aux_layer_ids(hf)
    if found is None:  # the target model's get_eagle3_aux_hidden_state_layers
        return default_aux_ids(n), f"the target's default {DEFAULT_IDS_TEXT}, n = {n}"
    return tuple(found[0]), ("nested " if found[1] == NESTED else "top-level ") + found[1]


class Report:
    """The lines ``check`` prints, each also kept as a record for --json."""

    def __init__(self) -> None:
        self.records: list[dict[str, str]] = []
        self.problems = 0
        self.blamed: set[str] = set()
        self.header: str | None = None

    @property
    def lines(self) -> list[str]:
        out = [self.header] if self.header else []
        for r in self.records:
            text = {"ok": "ok    ", "warn": "warn  ", "fail": "FAIL  ",
                    "verdict": ""}[r["status"]] + r["message"]
            out.append(text + (f"; fix: {r['fix']}" if r.get("fix") else ""))
        return out

    def ok(self, msg: str) -> None:
        self.records.append({"status": "ok", "message": msg})

    def warn(self, msg: str, fix: str | None = None) -> None:
        self.records.append({"status": "warn", "message": msg, **({"fix": fix} if fix else {})})

    def fail(self, msg: str, fix: str, *tensors: str) -> None:
        """``tensors``: checkpoint names (or name prefixes) this line already
        explains; the load check names no other problem with them."""
        self.problems += 1
        self.blamed.update(k for t in tensors for k in (_ckpt_key(t), _param_key(t)))
        self.records.append({"status": "fail", "message": msg, "fix": fix})

    def retract(self, prefix: str) -> None:
        """Drop the ok lines that start with ``prefix`` (a later check found
        what they passed wrong)."""
        self.records = [r for r in self.records
                        if not (r["status"] == "ok" and r["message"].startswith(prefix))]

    def explained(self, name: str) -> bool:
        key = _param_key(name).replace("draft_id_to_target_id", "d2t")
        return any(key.startswith(b) for b in self.blamed)


@contextlib.contextmanager
def _a_platform_to_build_on() -> Iterator[None]:
    """``check`` builds the drafter class on the meta device: no kernel runs
    and no memory is taken, but vLLM's layers ask the platform which
    attention backend to build. The CUDA wheel on a machine without a GPU has
    none (UnspecifiedPlatform: "Invalid attention backend for None"), so
    there the CPU platform answers, as it does for the CPU build. The verdicts
    do not depend on it: weight names and shapes are the same under every
    backend (MLA is checked off, below)."""
    from vllm.platforms import current_platform

    if not current_platform.is_unspecified():
        yield
        return
    from vllm.platforms.cpu import CpuPlatform

    # Every module holds the same platform object: change what it is.
    was = current_platform.__class__
    current_platform.__class__ = CpuPlatform
    try:
        yield
    finally:
        current_platform.__class__ = was


def _build_on_meta(cls: type, vllm_config: Any) -> Any:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    # Each build registers its attention layers by name in the config.
    vllm_config.compilation_config.static_forward_context.clear()
    with set_current_vllm_config(vllm_config), \
            set_default_torch_dtype(vllm_config.model_config.dtype), torch.device("meta"):
        return cls(vllm_config=vllm_config, prefix="")


def _load_on_meta(cls: type, vllm_config: Any, headers: dict, rep: Report) -> None:
    """Run the class's own load_weights over meta tensors shaped as the
    headers say, recording each parameter a loader was called for. A tensor
    the class refuses is dropped and the load retried, so every one is named."""
    import torch
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    def tensor(name: str) -> torch.Tensor:
        shape, dtype = headers[name]
        if name in ("d2t", "t2d"):  # MLA's loader range-checks d2t on the CPU
            return torch.zeros(shape, dtype=getattr(torch, dtype, torch.int64))
        return torch.empty(shape, dtype=getattr(torch, dtype, torch.float32), device="meta")

    remaining = sorted(headers)
    while True:
        model = _build_on_meta(cls, vllm_config)
        loaded: set[str] = set()
        errors: dict[str, str] = {}
        for pname, param in model.named_parameters():
            original = getattr(param, "weight_loader", default_weight_loader)

            def record(p: Any, w: Any, *args: Any, _n: str = pname, _o: Any = original,
                       **kw: Any) -> None:
                loaded.add(_n)
                try:
                    _o(p, w, *args, **kw)
                except Exception as e:  # a shape the parameter cannot take
                    errors.setdefault(_n, f"{type(e).__name__}: {e}".strip())

            param.weight_loader = record
        try:
            model.load_weights((n, tensor(n)) for n in remaining)
        except Exception as e:
            text = str(e)
            culprit = next((n for n in remaining if _ckpt_key(n) in text), None)
            if culprit is None and any(b in text for b in rep.blamed if b):
                return  # the class refuses what a line above explains
            if culprit is None:
                rep.fail(f"vLLM's {cls.__name__} refuses the checkpoint: {text}",
                         "give the checkpoint every tensor the config implies")
                return
            if not rep.explained(culprit):
                rep.fail(f"{cls.__name__} would not load {culprit!r} ({type(e).__name__}: "
                         f"{text})", "remove the tensor, or fix the config or architecture "
                         "that left the class without it", culprit)
            remaining.remove(culprit)
            continue
        break
    for pname, err in sorted(errors.items()):
        if not rep.explained(pname):
            rep.fail(f"{cls.__name__} cannot load {pname}: {err}",
                     "the tensor's shape must be what the config implies")
    missing = sorted(n for n, _ in model.named_parameters() if n not in loaded
                     and n not in SHARED_OR_DEFAULT and not rep.explained(n))
    if missing:
        rep.fail(f"the checkpoint lacks {missing}, which {cls.__name__} creates and would "
                 "serve uninitialised", "use the checkpoint the config was written for, or "
                 "fix the config so the class does not create them")
    elif not rep.problems:
        rep.ok(f"{cls.__name__}.load_weights takes all {len(headers)} tensors; none it "
               "needs is missing")


def check(drafter: Path, target: Path, trust_remote_code: bool = False) -> Report:
    """The report: its lines and problems."""
    drafter, target = Path(drafter), Path(target)
    # Malformed files are named with line and column before vLLM reads them.
    read_config(drafter, "drafter")
    read_config(target, "target")
    # The drafter classes name their weights the same with MLA on or off, and
    # the CPU platform cannot build MLA attention: check with it off.
    refusals: list[str] = []
    with _env(VLLM_MLA_DISABLE="1"), _a_platform_to_build_on(), _one_process_world(), \
            _engine_id_check_reported(drafter, target, trust_remote_code, refusals):
        return _check(drafter, target, trust_remote_code, refusals)


def _check(drafter: Path, target: Path, trust_remote_code: bool,
           refusals: list[str]) -> Report:
    from vllm.config import (CacheConfig, CompilationConfig, CompilationMode, DeviceConfig,
                             VllmConfig)
    from vllm.model_executor.models import deepseek_eagle3
    from vllm.model_executor.models.registry import ModelRegistry

    rep = Report()
    try:
        tcfg, spec = configs(drafter, target, trust_remote_code)
    except ToolError as e:
        if "are not supported for now" not in str(e):
            raise
        archs = read_config(drafter, "drafter").get("architectures")
        rep.fail(f"architectures {archs} resolve to no vLLM class",
                 "set architectures to LlamaForCausalLMEagle3 (Llama draft layer) or "
                 "Eagle3DeepseekV2ForCausalLM (DeepSeek MLA draft layer)")
        return _finish(rep)
    draft = spec.draft_model_config
    hf, text = draft.hf_config, tcfg.hf_text_config
    n, t_hidden, t_vocab = text.num_hidden_layers, tcfg.get_hidden_size(), text.vocab_size
    rep.header = (f"drafter {drafter} -> target {target} ({text.model_type}, {n} layers, "
                  f"hidden {t_hidden}, vocab {t_vocab})")

    archs = list(getattr(hf, "architectures", None) or [])
    try:
        cls, _ = ModelRegistry.resolve_model_cls(draft.architectures, draft)
    except Exception as e:
        cls = None
        rep.fail(f"architectures {archs} resolve to no vLLM class ({e})",
                 "set architectures to LlamaForCausalLMEagle3 (Llama draft layer) or "
                 "Eagle3DeepseekV2ForCausalLM (DeepSeek MLA draft layer)")
    if cls is not None and not hasattr(cls, "combine_hidden_states"):
        rep.fail(f"architectures {archs} resolve to {cls.__name__}, which is not an EAGLE-3 "
                 "drafter (no combine_hidden_states)",
                 "set architectures to LlamaForCausalLMEagle3 or Eagle3DeepseekV2ForCausalLM")
        cls = None
    elif cls is not None:
        rep.ok(f"architectures {archs} -> vLLM {cls.__name__}")

    try:
        ids, source = engine_ids(hf, n)
    except ValueError as e:  # the two places disagree, hold no list, or no eagle_config
        if "eagle_config must be" in str(e):
            rep.fail(f"vLLM refuses the drafter config: {str(e).split(': write', 1)[0]}",
                     "write eagle_config in config.json as a JSON object, or delete it")
        else:
            rep.fail(f"vLLM refuses the drafter's ids: {e}", "keep the one list the drafter "
                     "was trained with (`show`, then `convert`)")
        return _finish(rep)
    bad = [k for k in ids if not 0 <= k <= n]
    if not bad and list(ids) == sorted(set(ids)):
        # The engine refuses ids the lines below pass: its own sentence, once.
        for r in refusals:
            rep.fail(f"the engine refuses these aux ids at start: {r.rstrip('. ')}",
                     "keep the ids the drafter was trained with, in vLLM's numbering")
    if bad:
        rep.fail(f"aux ids {list(ids)} (from {source}) include {bad}, outside [0, {n}]",
                 "the ids are for another target, or numbered by output with the last "
                 f"layer's output written as {n} + 1: see `show`, then `convert`")
    elif list(ids) != sorted(set(ids)):
        rep.fail(f"aux ids {list(ids)} (from {source}) are not strictly ascending",
                 "vLLM returns states in layer order, so fc would get them permuted; "
                 "the drafter cannot be served as trained")
    else:
        rep.ok(f"aux ids {list(ids)} from {source}: in [0, {n}], ascending")
    if not source.startswith(("top", "nested")) and text.model_type in DEEPSEEK_FAMILY:
        rep.warn(f"the drafter names no aux ids ({TOP} nor {NESTED}), so vLLM feeds it the "
                 f"{text.model_type} target's default {list(ids)} {DEFAULT_IDS_TEXT}; "
                 "a drafter trained on other layers drafts almost nothing",
                 f"put the training run's ids in the config (`convert --ids`), or run "
                 f"`calibrate` to measure which reading fits")
    cfg = read_config(drafter, "drafter")
    prov = provenance(cfg, drafter)
    named = source.startswith(("top", "nested"))
    if prov is not None and prov["numbering"] == "output-of-layer" and named:
        rep.fail(f"aux ids {list(ids)} are numbered by output ({prov['why']}): served as "
                 "they are, every state comes one layer early",
                 f"vllm-eagle3 convert {drafter} --from output-of-layer")
    elif prov is not None:
        (rep.ok if prov["numbering"] else rep.warn)(provenance_line(prov))
    if source.startswith("nested") and not (prov and prov["numbering"]):
        rep.warn(f"ids only in {NESTED}, which SGLang, SpecForge, TorchSpec training and "
                 f"ModelOpt number by output: as read, inputs of layers {list(ids)}; as outputs, "
                 f"vLLM ids {[k + 1 for k in ids]}. `calibrate` measures which, `convert` "
                 f"writes {TOP}")

    is_mla_drafter = cls is getattr(deepseek_eagle3, "Eagle3DeepseekV2ForCausalLM", None)
    if is_mla_drafter and tcfg.is_deepseek_mla:
        # The fields the class compares itself when the target runs MLA.
        diff = [f"{f} {getattr(hf, f, None)} vs {getattr(text, f, None)}"
                for f in deepseek_eagle3._MLA_SHARED_FIELDS
                if getattr(hf, f, None) != getattr(text, f, None)]
        if diff:
            rep.fail("the MLA draft layer shares the target's MLA KV cache, but its geometry "
                     "differs (drafter vs target): " + "; ".join(diff),
                     "use a drafter trained for this target")
        else:
            rep.ok("MLA draft layer geometry equals the target's ("
                   + ", ".join(deepseek_eagle3._MLA_SHARED_FIELDS) + ")")

    weights = Weights(drafter)
    headers = weights.headers
    for msg, fix, tensors in weights.problems:
        rep.fail(msg, fix, *tensors)
    # Every clash the configs show, then the weights' own lines.
    _check_tensors(rep, hf, headers, ids, t_hidden, t_vocab, is_mla_drafter)
    if not headers:
        if not weights.problems:
            rep.fail(f"no safetensors weights in {drafter} (nor pytorch_model*.bin)",
                     "download the weights (*.safetensors, and model.safetensors.index.json "
                     "if sharded)")
        return _finish(rep)
    for flag, fix_on in (("fc_norm", "fc_norm."), ("norm_before_fc", "input_norm.")):
        present = sorted(k for k in headers if _ckpt_key(k).startswith(fix_on))
        if getattr(hf, flag, False) and not present:
            rep.fail(f"{flag} is set but the checkpoint has no {fix_on}* tensor",
                     f"set \"{flag}\": false if the drafter was trained without it, or get "
                     "the weights it was trained with", fix_on)
        elif present and not getattr(hf, flag, False):
            rep.fail(f"the checkpoint has {present} but {flag} is not set",
                     f"set \"{flag}\": true in config.json", *present)
    if cls is not None:
        vllm_config = VllmConfig(
            model_config=tcfg, speculative_config=spec, device_config=DeviceConfig("cpu"),
            cache_config=CacheConfig(block_size=16),
            compilation_config=CompilationConfig(mode=CompilationMode.NONE))
        try:
            model = _build_on_meta(cls, vllm_config)
        except Exception as e:
            rep.fail(f"vLLM's {cls.__name__} refuses the drafter config: {e}",
                     "fix the config field the message names")
        else:
            _check_flags_honoured(rep, hf, model, cls)
            _check_fc_width(rep, hf, model, cls, ids)
            _load_on_meta(cls, vllm_config, headers, rep)
    return _finish(rep)


def _check_flags_honoured(rep: Report, hf: Any, model: Any, cls: type) -> None:
    """A flag the built class shows no sign of is one it would silently ignore
    (vLLM #38111, #42143, #43482): fc_norm builds model.fc_norm, norm_output
    sets model.norm_output, norm_before_fc (upstream, after v0.16) builds
    model.input_norm."""
    for flag, attr in (("fc_norm", "fc_norm"), ("norm_output", "norm_output"),
                       ("norm_before_fc", "input_norm")):
        if getattr(hf, flag, False) and not getattr(model.model, attr, None):
            rep.fail(f"{flag} is set but the installed {cls.__name__} ignores it: the "
                     "drafter would be served without it",
                     "install a vLLM that implements it (this series does fc_norm and "
                     "norm_output)", attr + ".")


def _check_fc_width(rep: Report, hf: Any, model: Any, cls: type,
                    ids: tuple[int, ...]) -> None:
    """How many aux states the built class fuses against how many ids the
    engine feeds it: v0.16.0's Llama drafter sizes fc for exactly 3
    (llama_eagle3.py: target_hidden_size * 3), whatever the ids."""
    fc = getattr(model.model, "fc", None)
    if fc is None or not ids:
        return
    width = getattr(fc, "input_size", None) or fc.weight.shape[-1]
    each = getattr(hf, "target_hidden_size", None) or hf.hidden_size
    if width == len(ids) * each:
        return
    rep.retract("fc.weight in-features")
    rep.fail(f"vLLM's {cls.__name__} fuses exactly {width // each} aux states (its fc takes "
             f"{width} = {width // each} x {each}), but the drafter names {len(ids)} aux ids "
             f"{list(ids)}",
             f"this drafter cannot be served by vLLM 0.16's {cls.__name__}: use one trained "
             f"on {width // each} target layers", "fc.weight")


def _check_tensors(rep: Report, hf: Any, headers: dict, ids: tuple[int, ...],
                   t_hidden: int, t_vocab: int, is_mla_drafter: bool = False) -> None:
    """The sizes the configs imply against the target's, and (when there are
    weights) against the tensors' shapes and dtypes."""
    by_key = {_ckpt_key(k): k for k in headers}
    h = hf.hidden_size
    field = "target_hidden_size" if getattr(hf, "target_hidden_size", None) else "hidden_size"
    hidden_in = getattr(hf, field)
    if hidden_in != t_hidden:
        rep.fail(f"the drafter reads target states of width {hidden_in} ({field}), the "
                 f"target's hidden size is {t_hidden}", "use a drafter for this target")
    elif headers and "embed_tokens.weight" not in by_key and h != t_hidden:
        rep.fail(f"the checkpoint has no embed_tokens, so vLLM shares the target's "
                 f"({t_hidden} wide), but the drafter's hidden_size is {h}",
                 "get the drafter's own embed_tokens weights")
    else:
        rep.ok(f"hidden sizes: target states {t_hidden} wide, drafter hidden {h}")
    fc = by_key.get("fc.weight")
    from vllm.config.speculative import eagle3_config_dict

    uses_aux = bool(eagle3_config_dict(hf).get("use_aux_hidden_state", True))
    if not uses_aux and fc is not None:
        rep.fail(f"eagle_config.use_aux_hidden_state is false, so vLLM builds the drafter "
                 f"without fc and never loads {fc}: it would be served without the layer that "
                 "fuses the target's states",
                 "delete \"use_aux_hidden_state\": false from eagle_config (the checkpoint's "
                 "fc says the drafter was trained on aux states)", fc)
    elif not uses_aux:
        pass
    elif not headers or (fc is None and rep.explained("fc.weight")):
        pass  # no weights, or fc's file is missing: said already
    elif fc is None:
        rep.fail("the checkpoint has no fc.weight (the layer that fuses the aux states)",
                 "get the complete drafter checkpoint")
    elif rep.problems and headers[fc][0][-1] % t_hidden:
        pass  # the width mismatch above explains it
    elif headers[fc][0][-1] != len(ids) * t_hidden:
        trained = headers[fc][0][-1] // t_hidden
        rep.fail(f"{fc} takes {headers[fc][0][-1]} inputs = {trained} x the target's "
                 f"hidden {t_hidden}, but the engine feeds {len(ids)} aux states ({list(ids)})",
                 f"list the {trained} layer ids the drafter was trained on "
                 f"(`convert --ids`)", fc)
    else:
        rep.ok(f"{fc} in-features {headers[fc][0][-1]} = {len(ids)} aux ids x {t_hidden}")

    vocab, dv = hf.vocab_size, getattr(hf, "draft_vocab_size", None) or hf.vocab_size
    problems = rep.problems
    if vocab != t_vocab:
        rep.fail(f"the drafter's vocab_size {vocab} is not the target's {t_vocab} (its "
                 "logits are scattered into the target's vocabulary)",
                 "use a drafter trained with this target's tokenizer")
    if dv > t_vocab:
        rep.fail(f"draft_vocab_size {dv} exceeds the target's vocabulary {t_vocab}",
                 "use a drafter trained with this target's tokenizer")
    if "t2d" in by_key and headers[by_key["t2d"]][0] != (vocab,):
        got = list(headers[by_key["t2d"]][0])
        if is_mla_drafter:
            rep.fail(f"{by_key['t2d']} has shape {got}, vocab_size implies [{vocab}]: the MLA "
                     "drafter refuses it, though vLLM drafts with d2t alone",
                     "delete t2d from the checkpoint, or re-export it with vocab_size entries",
                     by_key["t2d"])
        else:
            rep.warn(f"{by_key['t2d']} has shape {got}, vocab_size implies [{vocab}]: harmless, "
                     "vLLM's Llama drafter never reads t2d (only d2t)")
    for name, want in (("d2t", (dv,)), ("lm_head.weight", (dv, h))):
        if name in by_key and headers[by_key[name]][0] != want:
            rep.fail(f"{by_key[name]} has shape {list(headers[by_key[name]][0])}, the config "
                     f"implies {list(want)} (draft_vocab_size {dv}, vocab_size {vocab})",
                     "set draft_vocab_size to the size the drafter was trained with",
                     by_key[name])
    if headers and "d2t" not in by_key and dv != vocab:
        rep.fail(f"draft_vocab_size {dv} != vocab_size {vocab} but there is no d2t tensor "
                 "to map draft ids to target ids", "get the d2t tensor the drafter was "
                 "trained with")
    for name, kinds in (("d2t", ("int64", "int32")), ("t2d", ("bool",))):
        if name in by_key and headers[by_key[name]][1] not in kinds:
            rep.fail(f"{name} is stored as {headers[by_key[name]][1]}, not {' or '.join(kinds)}",
                     "re-export the drafter's vocabulary mapping", by_key[name])
    if rep.problems == problems:
        rep.ok(f"vocabulary: draft {dv} of the target's {t_vocab}"
               + ("" if not headers else ", d2t/t2d match" if "d2t" in by_key
                  else ", no d2t (identity)"))
    odd = sorted({d for k, (_, d) in headers.items()
                  if _ckpt_key(k) not in ("d2t", "t2d")} - FLOATS)
    if not headers:
        return
    if odd and getattr(hf, "quantization_config", None) is None:
        rep.fail(f"weights stored as {odd} with no quantization_config: loaded as plain "
                 "floats, without their scales", "use an unquantized export of the drafter")
    elif not odd:
        dtypes = sorted({d for k, (_, d) in headers.items() if d in FLOATS})
        rep.ok(f"weights stored as {', '.join(dtypes)}, served as the target's dtype")


def _finish(rep: Report) -> Report:
    rep.records.append({"status": "verdict", "message": "the pair fits" if not rep.problems else
                        f"{rep.problems} problem{'s' * (rep.problems > 1)}: the pair does "
                        "not fit"})
    return rep


# ------------------------------------------------------------------ calibrate

READINGS = ("input-of-layer", "output-of-layer")
K = 3
MIN_GAP = 0.05  # mean acceptance length, on top of 3 standard errors
# Text a chat model continues predictably; any file of one prompt a line will do.
DEFAULT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Monday, Tuesday, Wednesday, Thursday,",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "Speculative decoding drafts several tokens and the target model",
    "import numpy as np\nimport torch\nfrom torch import",
    "Water boils at 100 degrees Celsius and freezes at",
    "Once upon a time, in a small village by the sea, there lived",
)
# The CPU engine as the CPU end-to-end tests run it (tests/e2e/cpu harness):
# no MLA kernels on CPU, in-process so the capture hooks reach the runner,
# and the rotary custom op off (v0.16.0's CPU kernel mis-rotates DeepSeek's
# strided q_pe).
CPU_ENV = {"VLLM_MLA_DISABLE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}


class Acceptance:
    """Per-position accepted counts of N drafts of K tokens each: what vLLM's
    spec-decode metrics count (num_drafts, num_accepted_tokens_per_pos)."""

    def __init__(self, drafts: int, per_pos: list[int]) -> None:
        self.drafts, self.per_pos = drafts, per_pos

    def mean_length(self) -> float:
        return 1 + sum(self.per_pos) / self.drafts if self.drafts else float("nan")

    def variance(self) -> float:
        """Of the accepted count per draft: count(a >= j) gives count(a == j)."""
        counts = [self.drafts - self.per_pos[0]] + [
            a - b for a, b in zip(self.per_pos, self.per_pos[1:] + [0])]
        mean = self.mean_length() - 1
        return sum(c * (j - mean) ** 2 for j, c in enumerate(counts)) / max(1, self.drafts - 1)

    def line(self, label: str) -> str:
        rates = " ".join(f"{c / self.drafts:.2f}" for c in self.per_pos)
        return (f"{label}: mean acceptance length {self.mean_length():.2f} "
                f"over {self.drafts} drafts; accepted at position 1..{len(self.per_pos)}: {rates}")


def verdict_detail(results: dict[str, Acceptance | None]) -> dict[str, Any]:
    """The best reading against the runner-up. A reading wins when its mean
    acceptance length beats the runner-up's by at least MIN_GAP and by 3
    standard errors of the difference; a reading the target cannot capture
    (None: an id past its last layer) is scored as a drafter that never hits,
    so it loses only to a reading that beats no acceptance at all by the same
    margin."""
    measured = next(a for a in results.values() if a is not None)
    zero = Acceptance(max(1, measured.drafts), [0] * K)
    full = {r: a or zero for r, a in results.items()}
    best, second = sorted(full, key=lambda r: -full[r].mean_length())[:2]
    a, b = full[second], full[best]
    gap = b.mean_length() - a.mean_length()
    se = (a.variance() / max(1, a.drafts) + b.variance() / max(1, b.drafts)) ** 0.5
    need = max(MIN_GAP, 3 * se)
    return {"best": best, "runner_up": second, "margin": round(gap, 4),
            "needed": round(need, 4),
            "verdict": best if gap >= need else "undetermined",
            "why": f"{best} beats {second} by {gap:.2f} in mean acceptance length, "
                   f"needed {need:.2f}"}


def verdict(results: dict[str, Acceptance | None]) -> tuple[str, str]:
    """(verdict, why): verdict_detail's."""
    d = verdict_detail(results)
    return d["verdict"], d["why"]


def _chained_drafts(model: Any, tokens: Any, fused: Any, start: int, k: int) -> list[int]:
    """k greedy drafts from row ``start`` as the EAGLE proposer chains them:
    row i reads token i + 1 at position i with the target's fused state i; each
    later step appends the last draft at the next position with the drafter's
    own returned hidden state. Rows are recomputed causally each step, which
    is what the KV cache holds."""
    import torch

    ids, pos, hid = tokens[1:start + 2], torch.arange(start + 1), fused[:start + 1]
    drafts = []
    for _ in range(k):
        out, back = model(ids, pos, hid)
        d = int(model.compute_logits(out[-1:]).argmax(-1))
        drafts.append(d)
        ids = torch.cat([ids, ids.new_tensor([d])])
        pos = torch.cat([pos, pos[-1:] + 1])
        hid = torch.cat([hid, back[-1:]])
    return drafts


class _CausalAttention:
    """Stands in for vLLM's paged Attention layer (whose KV cache and metadata
    only a scheduled engine step has): the same q/k/v in, softmax attention
    over the rows so far out."""

    def __init__(self, attn: Any) -> None:
        self.h, self.kvh = attn.num_heads, attn.num_kv_heads
        self.d, self.dv, self.scale = attn.head_size, attn.head_size_v, attn.impl.scale

    def __call__(self, q: Any, k: Any, v: Any, *args: Any, **kw: Any) -> Any:
        import torch.nn.functional as F

        T = q.shape[0]
        q, k, v = (t.reshape(T, n, -1).transpose(0, 1)
                   for t, n in ((q, self.h), (k, self.kvh), (v, self.kvh)))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                             enable_gqa=self.h != self.kvh)
        return out.transpose(0, 1).reshape(T, -1)


def _worker_capture(worker: Any, layers: tuple[int, ...]) -> None:
    """On the engine's worker: capture ``layers`` (the model's SupportsEagle3
    hook, as GPUModelRunner._set_eagle3_aux_layers calls it) and keep every
    step's aux states with its request ids and token counts."""
    runner = worker.model_runner
    runner.get_model().set_aux_hidden_state_layers(layers)
    runner.use_aux_hidden_state_outputs = True
    log: list[dict[str, Any]] = []
    worker.eagle3_calibrate_log = log
    original = runner.execute_model

    def execute_model(sched: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(sched, *args, **kwargs)
        state, n = runner.execute_model_state, sched.total_num_scheduled_tokens
        if state is not None and n:
            req_ids = list(runner.input_batch.req_ids)
            log.append({"counts": [(r, sched.num_scheduled_tokens[r]) for r in req_ids],
                        "ids": runner.input_ids.cpu[:n].tolist(),
                        "aux": [a[:n].clone() for a in state.aux_hidden_states]})
        return out

    runner.execute_model = execute_model


def _worker_score(worker: Any, drafter: str, layers: tuple[int, ...],
                  readings: dict[str, tuple[int, ...]], seqs: list[dict[str, Any]],
                  k: int) -> dict[str, Acceptance]:
    """On the worker: load the drafter as the EAGLE proposer does (its own
    load_model: vLLM's loader, embeddings and lm_head shared from the target
    when the checkpoint has none), then replay greedy speculative decoding
    for each reading."""
    import torch
    from vllm.config import SpeculativeConfig
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.spec_decode.eagle import EagleProposer
    from vllm.v1.worker.cpu_model_runner import _torch_cuda_wrapper

    runner = worker.model_runner
    config = runner.vllm_config
    config.speculative_config = SpeculativeConfig(
        method="eagle3", model=drafter, num_speculative_tokens=k,
        target_model_config=runner.model_config, target_parallel_config=runner.parallel_config)
    try:
        with _torch_cuda_wrapper():
            proposer = EagleProposer(config, runner.device, runner)
        proposer.load_model(runner.get_model())
    finally:
        config.speculative_config = None
    model = proposer.model.eval()
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Attention):
                object.__setattr__(module, name, _CausalAttention(child))
    results = {}
    bar = _progress(len(readings) * len(seqs), "calibrate: replaying drafts (reading x prompt)")
    with torch.inference_mode(), bar:
        for reading, ids in readings.items():
            drafts, per_pos = 0, [0] * k
            cols = [layers.index(i) for i in ids]
            for seq in seqs:
                tokens, prompt_len = seq["tokens"], seq["prompt_len"]
                aux = torch.cat([seq["aux"][c] for c in cols], dim=-1)
                with set_forward_context(None, config, num_tokens=len(tokens)):
                    fused = model.combine_hidden_states(aux.to(runner.model_config.dtype))
                    t = prompt_len - 1
                    while t + 1 + k < len(tokens):
                        want = tokens[t + 2:t + 2 + k].tolist()
                        got = _chained_drafts(model, tokens, fused, t, k)
                        a = next((j for j in range(k) if got[j] != want[j]), k)
                        drafts += 1
                        for j in range(a):
                            per_pos[j] += 1
                        t += a + 1  # the target keeps a drafts and adds its own token
                bar.update(1)
            results[reading] = Acceptance(drafts, per_pos)
    return results


def _rows(log: list[dict[str, Any]], prompts: list[list[int]], outputs: list[list[int]]
          ) -> list[dict[str, Any]]:
    """Per prompt: its tokens (prompt + greedy output) and, per captured
    layer, the state of every token fed (the last sampled one never is)."""
    import torch

    fed: dict[str, list[int]] = {}
    aux: dict[str, list[list[Any]]] = {}
    for step in log:
        start = 0
        for req, count in step["counts"]:
            fed.setdefault(req, []).extend(step["ids"][start:start + count])
            aux.setdefault(req, []).append([a[start:start + count] for a in step["aux"]])
            start += count
    seqs = []
    for prompt, output in zip(prompts, outputs):
        tokens = prompt + output
        req = next((r for r, ids in fed.items() if ids == tokens[:-1]), None)
        if req is None:
            raise ToolError("the engine's captured rows match no prompt: was prefix caching "
                             "on, or did a request stop early?")
        seqs.append({"tokens": torch.tensor(tokens), "prompt_len": len(prompt),
                     "aux": [torch.cat(col) for col in zip(*aux.pop(req))]})
        del fed[req]
    return seqs


def _read_prompts(path: Path | None) -> list[str]:
    if path is None:
        return list(DEFAULT_PROMPTS)
    try:
        prompts = [line for line in Path(path).read_text().splitlines() if line.strip()]
    except OSError as e:
        raise ToolError(f"cannot read --prompts {path}: {e}") from None
    if not prompts:
        raise ToolError(f"--prompts {path} holds no prompt (one a line)")
    return prompts


@contextlib.contextmanager
def _engine(**kwargs: Any) -> Iterator[Any]:
    from vllm import LLM
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm = None
    try:
        with _quiet_stdout():
            llm = LLM(**kwargs)
        yield llm
    finally:
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
        del llm
        cleanup_dist_env_and_memory()


def _replay(drafter: Path, target: Path, readings: dict[str, tuple[int, ...]],
            prompts: list[str], max_tokens: int, engine_args: dict[str, Any]
            ) -> dict[str, Acceptance]:
    """The CPU path: one real engine run of the target that captures the
    layers of both readings, then vLLM's drafter class replaying greedy
    speculative decoding over those states."""
    from vllm import SamplingParams

    layers = tuple(sorted({k for ids in readings.values() for k in ids}))
    kwargs = {"model": str(target), "seed": 0, "enforce_eager": True, "max_model_len": 1024,
              "dtype": "float32",
              "enable_prefix_caching": False, "max_num_seqs": 8,
              "compilation_config": {"custom_ops": ["-rotary_embedding"]}, **engine_args}
    with _env(**CPU_ENV), _engine(**kwargs) as llm:
        llm.collective_rpc(_worker_capture, args=(layers,))
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        log = llm.collective_rpc(lambda worker: worker.eagle3_calibrate_log)[0]
        seqs = _rows(log, [list(o.prompt_token_ids) for o in outs],
                     [list(o.outputs[0].token_ids) for o in outs])
        return llm.collective_rpc(_worker_score,
                                  args=(str(drafter), layers, readings, seqs, K))[0]


def _spec_decode(drafter: Path, target: Path, readings: dict[str, tuple[int, ...]],
                 prompts: list[str], max_tokens: int, engine_args: dict[str, Any]
                 ) -> dict[str, Acceptance]:
    """The GPU path: serve the target with the drafter, once per reading (a
    copy with the reading's ids as vLLM ids), and read the engine's
    own spec-decode counters."""
    from vllm import SamplingParams

    results = {}
    for reading, ids in _progress(readings.items(), "calibrate: serving each reading",
                                  total=len(readings)):
        with tempfile.TemporaryDirectory() as tmp:
            copy = write_ids_copy(drafter, ids, Path(tmp) / "drafter")
            spec = {"method": "eagle3", "model": str(copy), "num_speculative_tokens": K}
            with _engine(model=str(target), speculative_config=spec, seed=0,
                         disable_log_stats=False, **engine_args) as llm:
                # Differences: the metrics live in the process-wide registry.
                before = _spec_counts(llm)
                llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                     ignore_eos=True), use_tqdm=True)
                after = _spec_counts(llm)
        results[reading] = Acceptance(after[0] - before[0],
                                      [a - b for a, b in zip(after[1], before[1])])
    return results


def _progress(it: Any, desc: str, total: int | None = None) -> Any:
    """A tqdm bar on stderr (vLLM's own dependency); stdout keeps the report."""
    from tqdm import tqdm

    if isinstance(it, int):
        return tqdm(total=it, desc=desc, file=sys.stderr, leave=False)
    return tqdm(it, desc=desc, total=total, file=sys.stderr, leave=False)


def _spec_counts(llm: Any) -> tuple[int, list[int]]:
    metrics = {m.name: m for m in llm.get_metrics()}
    drafts = metrics.get("vllm:spec_decode_num_drafts")
    per_pos = metrics.get("vllm:spec_decode_num_accepted_tokens_per_pos")
    return (int(drafts.value) if drafts else 0,
            [int(x) for x in per_pos.values] if per_pos else [0] * K)


def candidate_name(ids: tuple[int, ...]) -> str:
    return "ids " + ",".join(map(str, ids))


def calibrate(drafter: Path, target: Path, *, prompts: Path | None = None,
              max_tokens: int = 64, write: bool = False, via: str = "auto",
              engine_args: dict[str, Any] | None = None,
              candidates: list[tuple[int, ...]] | None = None) -> dict[str, Any]:
    """Measures every reading; the result ``--json`` prints, with the lines
    to print under "lines" and the verdict under "verdict"."""
    drafter, target = Path(drafter), Path(target)
    read_config(drafter, "drafter")
    read_config(target, "target")
    if (why := device_problem()) is not None:
        raise ToolError(f"calibrate runs the target model, and {why}. `check` needs no "
                        "device")
    from vllm.platforms import current_platform

    engine_args = dict(engine_args or {})
    trust = bool(engine_args.get("trust_remote_code"))
    tcfg, spec = configs(drafter, target, trust)
    n = tcfg.hf_text_config.num_hidden_layers
    if current_platform.is_cpu() and hasattr(tcfg.hf_text_config, "index_topk"):
        # DeepseekV2 builds the DSA indexer only with MLA on (its
        # topk_indices_buffer), and the CPU platform runs MLA off.
        raise ToolError(
            f"calibrate cannot run {target} on the CPU build: a "
            f"{tcfg.hf_text_config.model_type} target's DeepSeek Sparse Attention runs only in "
            "vLLM's MLA path, which the CPU platform lacks. Run calibrate on a CUDA GPU with "
            "the series' CUDA wheel (pip install "
            "dist/vllm-0.16.0+eagle3.*-manylinux_2_31_x86_64.whl); `check` runs here")
    try:
        ids, source = engine_ids(spec.draft_model_config.hf_config, n)
    except ValueError as e:
        raise ToolError(f"vLLM refuses the drafter's ids: {e}") from None
    wanted = {READINGS[0]: ids, READINGS[1]: tuple(k + 1 for k in ids)}
    for cand in candidates or ():
        if len(cand) != len(ids):
            raise ToolError(f"--candidates {','.join(map(str, cand))} names {len(cand)} ids; "
                            f"the drafter reads {len(ids)} ({list(ids)}, {source})")
        if list(cand) != sorted(set(cand)):
            raise ToolError(f"--candidates {','.join(map(str, cand))} is not strictly "
                            "ascending: vLLM returns the states in layer order")
        if cand not in wanted.values():
            wanted[candidate_name(cand)] = cand
    readings = {r: v for r, v in wanted.items() if all(0 <= k <= n for k in v)}
    if not readings:
        raise ToolError(f"aux ids {list(ids)} ({source}) are outside [0, {n}] under every "
                        "reading: is --target the drafter's target? (`check` says more)")
    if via == "auto":
        via = "replay" if current_platform.is_cpu() else "spec-decode"
    texts = _read_prompts(prompts)
    lines = [f"drafter {drafter}, target {target} ({n} layers): aux ids {list(ids)} from "
             f"{source}", f"{len(texts)} prompts x {max_tokens} greedy tokens, k = {K}, "
             + ("replayed by vLLM's drafter class over the states the CPU engine captured"
                if via == "replay" else "measured by the engine's spec-decode counters")]
    if via == "replay":
        results = _replay(drafter, target, readings, texts, max_tokens, engine_args)
    else:
        results = _spec_decode(drafter, target, readings, texts, max_tokens, engine_args)
    if not any(r.drafts for r in results.values()):
        raise ToolError(f"no draft was made in {max_tokens} tokens per prompt: raise "
                        "--max-tokens (each draft needs k + 1 tokens of continuation)")
    width = max(len(r) for r in wanted)
    report: list[dict[str, Any]] = []
    for reading, v in wanted.items():
        label = f"{reading:>{width}} {list(v)}"
        got = results.get(reading)
        lines.append(got.line(label) if got else
                     f"{label}: not capturable, id {max(v)} is past the last layer ({n})")
        report.append({"reading": reading, "ids": list(v), "capturable": got is not None,
                       **({"drafts": got.drafts, "mean_acceptance_length":
                           round(got.mean_length(), 4), "accepted_per_position": got.per_pos}
                          if got else {})})
    detail = verdict_detail({r: results.get(r) for r in wanted})
    lines += [f"margin rule: {detail['why']}", f"verdict: {detail['verdict']}"]
    result = {"drafter": str(drafter), "target": str(target), "target_layers": n,
              "aux_ids": list(ids), "source": source, "prompts": len(texts),
              "max_tokens": max_tokens, "k": K, "via": via, "readings": report,
              **{k: detail[k] for k in ("best", "runner_up", "margin", "needed", "verdict")},
              "written": None, "lines": lines}
    if write and detail["verdict"] == "undetermined":
        lines.append("nothing written: the verdict is undetermined; more prompts (--prompts "
                     "FILE, one a line) or longer ones (--max-tokens T) narrow the margin")
    elif write:
        has_ids = source.startswith(("top", "nested"))
        if detail["verdict"] in READINGS:
            written = convert(drafter, detail["verdict"], target=target,
                              ids=None if has_ids else ids)
        else:
            written = set_ids_in_place(drafter, wanted[detail["verdict"]],
                                       how="calibrate --candidates")
        lines += written
        result["written"] = written
    return result
