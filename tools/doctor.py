#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Tell whether EAGLE-3 will work for DeepSeek-family targets in the vLLM
that this Python imports.

For each architecture of the family it prints one line, OK or FAIL, covering
the three walls a user hits on stock vLLM v0.16.0:

  wall 1  config allow-list: SpeculativeConfig refuses method "eagle3" for
          the architecture's model types (checked with the real validator);
  wall 2  model interface: SupportsEagle3 missing from the MRO, or
          DeepseekV2Model.forward does not capture aux hidden states
          (checked by running the real forward on stand-in decoder layers);
  wall 3  Kimi-K2.5 image token: KimiK25Config has no image_token_index, which
          the EAGLE proposer reads for a multimodal target.

Exit status: 0 when every architecture is OK, 1 when any wall remains, 2
when vLLM cannot be imported at all. Nothing is downloaded and no GPU is
needed; the report goes to stdout, vLLM's own logging to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

# (architecture, model types this stack enables EAGLE-3 for on it). The
# model types are (text model type, top-level model type) pairs as
# ModelConfig reports them: Kimi-K2.5's text config is a DeepseekV3Config.
ARCHITECTURES: dict[str, list[tuple[str, str]]] = {
    "DeepseekV2ForCausalLM": [("deepseek_v2", "deepseek_v2")],
    # DeepSeek-V1 (model type "deepseek") is served by this class; the stack
    # gives it the interface through inheritance but enables no model type.
    "DeepseekForCausalLM": [],
    "DeepseekV3ForCausalLM": [
        ("deepseek_v3", "deepseek_v3"),
        ("deepseek_v32", "deepseek_v32"),
        ("kimi_k2", "kimi_k2"),
    ],
    "GlmMoeDsaForCausalLM": [("glm_moe_dsa", "glm_moe_dsa")],
    "KimiK25ForConditionalGeneration": [
        ("deepseek_v3", "kimi_k25"),
        ("kimi_k25", "kimi_k25"),
    ],
}
KIMI_ARCH = "KimiK25ForConditionalGeneration"
KIMI_DEFAULT_MEDIA_TOKEN = 163605
HIDDEN = 8
NUM_LAYERS = 6  # stand-in target depth for the functional check


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    wall: int | None = None  # which of the three walls a failure is

    def render(self) -> str:
        if self.ok:
            return f"{self.name}=ok" + (f"({self.detail})" if self.detail else "")
        return f"{self.name}=FAIL({self.detail}) [wall {self.wall}]"


@dataclass
class ArchReport:
    arch: str
    enabled_types: bool = True  # False: a base class with no model type enabled
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)

    def line(self, width: int) -> str:
        status = "OK  " if self.ok else "FAIL"
        if not self.ok:
            verdict = "EAGLE-3 blocked"
        elif self.enabled_types:
            verdict = "EAGLE-3 will work"
        else:
            verdict = "EAGLE-3 support in place (no model type enabled)"
        details = "; ".join(check.render() for check in self.checks)
        return f"{status} {self.arch:<{width}} {verdict}: {details}"


def _short(exc: BaseException, limit: int = 160) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _guarded(name: str, wall: int, fn: Callable[[], Check]) -> Check:
    """Run one check; an unexpected exception is a failed check, not a crash."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - report, never crash
        if os.environ.get("EAGLE3_DOCTOR_DEBUG"):
            traceback.print_exc()
        return Check(name, False, f"check raised {_short(exc)}", wall)


# ------------------------------------------------------------------ wall 1


def check_allow_list(model_types: list[tuple[str, str]]) -> Check:
    from vllm.config.speculative import SpeculativeConfig

    if not model_types:
        return Check(
            "allow-list",
            True,
            "no target model type of its own; DeepSeek-V1 'deepseek' is "
            "not enabled by this stack",
        )
    rejected: list[str] = []
    for text_type, top_type in model_types:
        config = object.__new__(SpeculativeConfig)
        fields: dict[str, Any] = {
            "tensor_parallel_size": None,
            "num_speculative_tokens": 3,
            "draft_model_config": None,
            "disable_by_batch_size": None,
            "method": "eagle3",
            "target_model_config": SimpleNamespace(
                hf_text_config=SimpleNamespace(model_type=text_type),
                hf_config=SimpleNamespace(model_type=top_type),
            ),
        }
        for name, value in fields.items():
            object.__setattr__(config, name, value)
        label = text_type if text_type == top_type else f"{top_type}/{text_type}"
        try:
            SpeculativeConfig._verify_args(config)
        except ValueError:
            rejected.append(label)
    accepted = sorted({t for t, top in model_types} | {top for _, top in model_types})
    if rejected:
        return Check("allow-list", False, "rejects " + ",".join(rejected), 1)
    return Check("allow-list", True, ",".join(accepted))


# ------------------------------------------------------------------ wall 2


def check_interface(cls: type) -> Check:
    from vllm.model_executor.models.interfaces import SupportsEagle3, supports_eagle3

    missing: list[str] = []
    if SupportsEagle3 not in cls.__mro__:
        missing.append("SupportsEagle3 not in MRO")
    if not supports_eagle3(cls):
        missing.append("supports_eagle3() is False")
    for method in ("set_aux_hidden_state_layers", "get_eagle3_aux_hidden_state_layers"):
        if not callable(getattr(cls, method, None)):
            missing.append(f"no {method}()")
    if missing:
        return Check("interface", False, ", ".join(missing), 2)
    return Check("interface", True, "")


def _stand_in_modules() -> tuple[type, type]:
    import torch
    from torch import nn

    class RecorderLayer(nn.Module):
        """The decoder layer's residual-stream contract, deterministically."""

        def __init__(self, idx: int) -> None:
            super().__init__()
            self.idx = idx
            self.inputs: list[torch.Tensor] = []

        def forward(
            self,
            positions: torch.Tensor,
            hidden_states: torch.Tensor,
            residual: torch.Tensor | None,
            llama_4_scaling: torch.Tensor | None = None,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            stream = hidden_states if residual is None else hidden_states + residual
            self.inputs.append(stream.clone())
            return torch.tanh(stream * (0.5 + 0.1 * self.idx)), stream

    class RecorderNorm(nn.Module):
        """Fused add + norm stand-in; records its (pre-norm) input stream."""

        def __init__(self) -> None:
            super().__init__()
            self.inputs: list[torch.Tensor] = []

        def forward(
            self, hidden_states: torch.Tensor, residual: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            stream = hidden_states + residual
            self.inputs.append(stream.clone())
            return stream * 0.5, stream

    return RecorderLayer, RecorderNorm


@contextlib.contextmanager
def _pipeline(module: ModuleType, world_size: int, rank: int) -> Iterator[None]:
    """Stand in for vLLM's pipeline-parallel group inside deepseek_v2."""
    group = SimpleNamespace(
        world_size=world_size,
        rank_in_group=rank,
        is_first_rank=rank == 0,
        is_last_rank=rank == world_size - 1,
    )
    saved = module.get_pp_group
    module.get_pp_group = lambda: group
    try:
        yield
    finally:
        module.get_pp_group = saved


def _make_inner_model(dsv2: ModuleType, start: int, end: int) -> Any:
    """A DeepseekV2Model holding layers [start, end), without its __init__."""
    import torch
    from torch import nn

    from vllm.model_executor.models.utils import PPMissingLayer

    recorder_cls, norm_cls = _stand_in_modules()
    torch.manual_seed(0)
    model = object.__new__(dsv2.DeepseekV2Model)
    nn.Module.__init__(model)
    model.config = SimpleNamespace(num_hidden_layers=NUM_LAYERS)
    model.embed_tokens = nn.Embedding(16, HIDDEN) if start == 0 else PPMissingLayer()
    model.start_layer, model.end_layer = start, end
    model.layers = nn.ModuleList(
        recorder_cls(i) if start <= i < end else PPMissingLayer()
        for i in range(NUM_LAYERS)
    )
    model.norm = norm_cls() if end == NUM_LAYERS else PPMissingLayer()
    model.do_not_compile = True  # plain forward, no torch.compile
    return model


def _make_target(dsv2: ModuleType, arch: str, inner: Any) -> Any:
    """The architecture's own class around the stand-in inner model."""
    from torch import nn

    text_cls = getattr(dsv2, "DeepseekV3ForCausalLM" if arch == KIMI_ARCH else arch)
    text = object.__new__(text_cls)
    nn.Module.__init__(text)
    text.config = SimpleNamespace(num_hidden_layers=NUM_LAYERS)
    text.model = inner
    if arch != KIMI_ARCH:
        return text
    from vllm.model_executor.models.kimi_k25 import KimiK25ForConditionalGeneration

    kimi = object.__new__(KimiK25ForConditionalGeneration)
    nn.Module.__init__(kimi)
    kimi.language_model = text
    return kimi


def _clear(model: Any) -> None:
    for module in model.modules():
        if isinstance(getattr(module, "inputs", None), list):
            module.inputs.clear()


def check_aux_capture(arch: str, cls: type) -> Check:
    """Run the architecture's real forward (and so DeepseekV2Model.forward)
    on stand-in layers, and compare the aux states with what the layers saw."""
    import torch

    from vllm.model_executor.models import deepseek_v2 as dsv2
    from vllm.sequence import IntermediateTensors

    if (
        arch != KIMI_ARCH
        and getattr(cls, "model_cls", None) is not dsv2.DeepseekV2Model
    ):
        return Check("aux-capture", False, f"model_cls is {cls.model_cls!r}", 2)

    input_ids = torch.tensor([3, 1, 4, 1, 5])
    positions = torch.arange(5)
    problems: list[str] = []
    ids = (0, 3, NUM_LAYERS)

    with _pipeline(dsv2, world_size=1, rank=0):
        inner = _make_inner_model(dsv2, 0, NUM_LAYERS)
        target = _make_target(dsv2, arch, inner)
        plain = target.forward(input_ids, positions)
        if not isinstance(plain, torch.Tensor):
            problems.append("output without capture is not a plain tensor")
        _clear(inner)

        setter = getattr(target, "set_aux_hidden_state_layers", None)
        if setter is None:
            problems.append("no set_aux_hidden_state_layers()")
            inner.aux_hidden_state_layers = ids  # still probe the forward
        else:
            setter(ids)
        out = target.forward(input_ids, positions)
        if not (isinstance(out, tuple) and len(out) == 2):
            problems.append("forward returns no aux hidden states")
        else:
            hidden, aux = out
            if not torch.equal(hidden, plain):
                problems.append("capture changed the output")
            expected = [
                ("id 0 (embedding)", inner.embed_tokens(input_ids)),
                ("id 3 (input of layer 3)", inner.layers[3].inputs[0]),
                (f"id {NUM_LAYERS} (pre-norm output)", inner.norm.inputs[0]),
            ]
            if len(aux) != len(expected):
                problems.append(f"{len(aux)} aux states for ids {list(ids)}")
            else:
                for (what, want), got in zip(expected, aux, strict=True):
                    if not torch.equal(got, want):
                        problems.append(f"wrong state for {what}")

        getter = getattr(target, "get_eagle3_aux_hidden_state_layers", None)
        want_ids = (2, NUM_LAYERS // 2, NUM_LAYERS - 3)
        if getter is not None and tuple(getter()) != want_ids:
            problems.append(f"default ids {getter()} != {want_ids}")
        if setter is not None:
            for bad in ((2, -1), (2, NUM_LAYERS + 1), (2, True), (2, "3")):
                try:
                    setter(bad)
                except ValueError:
                    continue
                problems.append(f"ids {bad!r} not rejected")

    with _pipeline(dsv2, world_size=2, rank=1):
        if setter is not None:
            try:
                setter((2, 3))
                problems.append("pipeline_parallel_size=2 not refused")
            except ValueError:
                pass
        # The last of two pipeline stages (layers 3..5): ids stay global.
        stage = _make_inner_model(dsv2, 3, NUM_LAYERS)
        stage.aux_hidden_state_layers = (4,)
        torch.manual_seed(1)
        tensors = IntermediateTensors(
            {
                "hidden_states": torch.randn(5, HIDDEN),
                "residual": torch.randn(5, HIDDEN),
            }
        )
        out = stage.forward(input_ids, positions, tensors)
        if isinstance(out, tuple) and not (
            len(out[1]) == 1 and torch.equal(out[1][0], stage.layers[4].inputs[0])
        ):
            problems.append("layer ids are not global under a pipeline split")

    if problems:
        return Check("aux-capture", False, "; ".join(problems), 2)
    return Check("aux-capture", True, "")


# ------------------------------------------------------------------ wall 3


def check_image_token(arch: str) -> Check:
    if arch != KIMI_ARCH:
        return Check("image-token", True, "n/a")
    from vllm.transformers_utils.configs import KimiK25Config

    default = KimiK25Config()
    custom = KimiK25Config(media_placeholder_token_id=KIMI_DEFAULT_MEDIA_TOKEN + 7)
    try:
        # What EagleProposer.load_model reads for a multimodal target.
        got = (default.image_token_index, custom.image_token_index)
    except AttributeError:
        return Check("image-token", False, "KimiK25Config has no image_token_index", 3)
    want = (default.media_placeholder_token_id, custom.media_placeholder_token_id)
    if got != want:
        return Check(
            "image-token", False, f"image_token_index {got} != placeholder {want}", 3
        )
    return Check("image-token", True, str(got[0]))


# ------------------------------------------------------------------ driver


def examine(arch: str, model_types: list[tuple[str, str]]) -> ArchReport:
    report = ArchReport(arch, enabled_types=bool(model_types))
    try:
        if arch == KIMI_ARCH:
            from vllm.model_executor.models import kimi_k25 as module
        else:
            from vllm.model_executor.models import deepseek_v2 as module
        cls = getattr(module, arch)
    except Exception as exc:  # noqa: BLE001
        report.checks.append(Check("import", False, _short(exc), 2))
        return report
    report.checks.append(
        _guarded("allow-list", 1, lambda: check_allow_list(model_types))
    )
    report.checks.append(_guarded("interface", 2, lambda: check_interface(cls)))
    report.checks.append(
        _guarded("aux-capture", 2, lambda: check_aux_capture(arch, cls))
    )
    report.checks.append(_guarded("image-token", 3, lambda: check_image_token(arch)))
    return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=(
            "Check whether EAGLE-3 speculative decoding will work for the "
            "DeepSeek-family architectures (DeepSeek-V2/V3/V3.2, Kimi-K2, "
            "Kimi-K2.5, GLM-5) in the vLLM this Python imports. Prints one "
            "OK/FAIL line per architecture; exits 1 if any wall remains."
        ),
        epilog=(
            "walls: 1 = speculative-config allow-list, 2 = SupportsEagle3 / "
            "aux hidden-state capture, 3 = Kimi-K2.5 image token. "
            "Set EAGLE3_DOCTOR_DEBUG=1 for tracebacks of failing checks."
        ),
    )
    parser.add_argument(
        "--arch",
        action="append",
        choices=sorted(ARCHITECTURES),
        metavar="ARCH",
        help=(
            "examine only this architecture (repeatable; default: all of "
            + ", ".join(ARCHITECTURES)
            + ")"
        ),
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Keep stdout for the report; vLLM logs to stdout unless told otherwise.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
    except Exception as exc:  # noqa: BLE001
        print(f"vllm: cannot import ({_short(exc)})")
        return 2

    if getattr(vllm, "__file__", None) is None:
        where = ", ".join(getattr(vllm, "__path__", [])) or "?"
        print(f"vllm: namespace package at {where} (no __init__.py): broken install")
        return 2
    vllm_file = Path(vllm.__file__).resolve()
    version = getattr(vllm, "__version__", "unknown")
    print(f"vllm: {vllm_file} (version {version})")
    repo_vllm = Path(__file__).resolve().parent.parent / "vllm"
    if vllm_file.parent == repo_vllm:
        print(
            f"note: this vllm is the repo-root source tree {repo_vllm}, not an install"
        )

    selected = args.arch or list(ARCHITECTURES)
    reports = [examine(arch, ARCHITECTURES[arch]) for arch in selected]
    width = max(len(arch) for arch in selected)
    for report in reports:
        print(report.line(width))

    walls = sorted(
        {
            check.wall
            for r in reports
            for check in r.checks
            if not check.ok and check.wall
        }
    )
    blocked = [r.arch for r in reports if not r.ok]
    if blocked:
        print(
            f"summary: EAGLE-3 blocked for {len(blocked)} of {len(reports)} "
            f"architecture(s); walls remaining: {', '.join(map(str, walls))}"
        )
        return 1
    print(f"summary: EAGLE-3 ready for all {len(reports)} architecture(s) examined")
    return 0


if __name__ == "__main__":
    sys.exit(main())
