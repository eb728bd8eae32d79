# SPDX-License-Identifier: Apache-2.0
"""The ``vllm-eagle3`` command's interface (tools/vllm_eagle3/cli.py): help
that explains every argument, the output lines and the exit statuses; and
the working directory never deciding which vLLM the tools, or vLLM's own
child processes, import."""

from __future__ import annotations

import argparse
import functools
import subprocess
import sys
from pathlib import Path

import pytest

from stack_tooling import REPO_ROOT, run_tool
from tools.vllm_eagle3 import cli
from tools.vllm_eagle3._base import children_never_shadowed

SUBCOMMANDS = ("doctor", "show", "check", "convert", "calibrate")


def _subparsers(ap: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_subcommand_and_argument_is_explained() -> None:
    subs = _subparsers(cli.build_parser())
    assert sorted(subs) == sorted(SUBCOMMANDS)
    for name, sp in subs.items():
        for action in sp._actions:
            if not isinstance(action, argparse._HelpAction):
                assert action.help, f"{name} {action.dest} has no help"


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_subcommand_help_names_output_and_exit_status(sub: str) -> None:
    proc = run_tool("eagle3_layers", sub, "--help")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith(f"usage: python -m tools.eagle3_layers {sub}")
    assert "output" in out and "exit status:" in out
    for code in ("  0  ", "  1  ", "  2  could not"):
        assert code in out, out
    assert "--json" in out and "-v, --verbose" in out


def test_help_from_the_package_entry_point() -> None:
    # `python -m tools.eagle3_fit --help` used to print nothing and exit 0.
    proc = subprocess.run([sys.executable, "-m", "vllm_eagle3", "--help"],
                          cwd=REPO_ROOT / "tools", capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: vllm-eagle3 "), proc
    assert all(s in proc.stdout for s in SUBCOMMANDS)
    assert "0 fits (or done), 1 a problem found, 2 could not check" in proc.stdout


def test_doctor_target_without_drafter_is_refused() -> None:
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "doctor.py"), "--target",
                           "/nonexistent"], cwd=REPO_ROOT / "tools", capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2
    assert "--target needs --drafter" in proc.stderr and proc.stdout == ""


def _vllm_in_a_registry_child() -> str:
    """The file ``vllm`` comes from in the child process vLLM starts to
    inspect a model class (registry._run_in_subprocess: ``python -m
    vllm.model_executor.models.registry``, the working directory inherited)."""
    from vllm.model_executor.models.registry import _run_in_subprocess

    return _run_in_subprocess(functools.partial(eval, "__import__('vllm').__file__"))


def test_vllm_child_processes_never_import_the_clone(monkeypatch: pytest.MonkeyPatch) -> None:
    """What `vllm serve` started in the clone's root meets: vLLM's
    model-inspection child imports the clone's vllm/ (the unpatched source),
    not the installed wheel. The tools set PYTHONSAFEPATH=1 for their
    children, which leaves the working directory off their path."""
    import sys

    import vllm
    from vllm.model_executor.models import registry

    installed = str(Path(vllm.__file__).resolve())
    monkeypatch.delenv("PYTHONSAFEPATH", raising=False)
    # vLLM's own command, without the -P that tests/conftest.py adds for the
    # rest of the suite.
    monkeypatch.setattr(registry, "_SUBPROCESS_COMMAND",
                        [sys.executable, "-m", "vllm.model_executor.models.registry"])
    monkeypatch.chdir(REPO_ROOT)
    assert Path(_vllm_in_a_registry_child()).resolve() == REPO_ROOT / "vllm" / "__init__.py"
    with children_never_shadowed():
        assert str(Path(_vllm_in_a_registry_child()).resolve()) == installed


def test_modules_are_layers_not_a_circle() -> None:
    """No module of the package imports one that imports it back (the tools
    it came from, eagle3_fit and eagle3_layers, imported each other), and
    none imports the clone's tools (the installed wheel has none)."""
    import ast

    pkg = REPO_ROOT / "tools" / "vllm_eagle3"
    graph: dict[str, set[str]] = {}
    for path in pkg.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("tools"), (path.name, node.module)
                if node.level == 1:
                    deps.add(node.module or "")
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("tools") for a in node.names), path.name
        graph[path.stem] = deps
    assert graph["_base"] == set()

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for d in graph.get(todo.pop(), ()):
                if d not in seen:
                    seen.add(d)
                    todo.append(d)
        return seen

    assert all(m not in reach(m) for m in graph), graph
