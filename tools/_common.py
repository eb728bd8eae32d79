"""What every tool shares: the one pin file, the download cache, the series."""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tomllib
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PATCHES_DIR = REPO_ROOT / "patches"
SERIES_FILE = PATCHES_DIR / "series"


class StackError(Exception):
    """An error the user can act on; tools print it without a traceback."""


@dataclass(frozen=True)
class Artifact:
    key: str
    project: str
    filename: str
    sha256: str


@dataclass(frozen=True)
class Pin:
    path: Path
    project: str
    version: str
    tag: str
    artifacts: dict[str, Artifact]
    local_label: str
    cpu_env: dict[str, str]

    def artifact(self, key: str) -> Artifact:
        if key not in self.artifacts:
            raise StackError(f"{self.path} pins no artifact {key!r} "
                             f"(pinned: {', '.join(sorted(self.artifacts))})")
        return self.artifacts[key]


def load_pin(path: Path | None = None) -> Pin:
    path = path or Path(os.environ.get("VLLM_EAGLE3_PIN", REPO_ROOT / "pin.toml"))
    try:
        data = tomllib.loads(path.read_text())
        up = data["upstream"]
        return Pin(path, up["project"], up["version"], up["tag"],
                   {k: Artifact(k, a["project"], a["filename"], a["sha256"].lower())
                    for k, a in data["artifacts"].items()},
                   data.get("build", {}).get("local_label", "stack"),
                   dict(data.get("cpu_env", {})))
    except FileNotFoundError:
        raise StackError(f"pin file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise StackError(f"pin file {path} is not valid TOML: {e}") from None
    except KeyError as e:
        raise StackError(f"pin file {path} lacks the field {e}") from None


def cache_dir() -> Path:
    """Where verified downloads live: per user, like pip's own cache."""
    if env := os.environ.get("VLLM_EAGLE3_CACHE"):
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() \
        / "vllm-eagle3-stack"


def offline_default() -> bool:
    return os.environ.get("VLLM_EAGLE3_OFFLINE", "") not in ("", "0")


def sha256_file(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def read_series(series: Path = SERIES_FILE) -> list[str]:
    """Patch names in apply order. Quilt's per-patch options are refused:
    the build applies every patch the same strict way."""
    if not series.exists():
        raise StackError(f"{series} does not exist (an empty series is an empty file)")
    names: list[str] = []
    for lineno, raw in enumerate(series.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if len(line.split()) != 1:
            raise StackError(
                f"{series}:{lineno}: {line!r} carries options; this stack applies "
                "every patch with -p1 and no fuzz, so list the file name alone")
        names.append(line)
    return names


def series_patches(series: Path = SERIES_FILE) -> list[Path]:
    """The series' patch files, in order; each must exist."""
    paths = [series.parent / name for name in read_series(series)]
    for p in paths:
        if not p.exists():
            raise StackError(f"{series} names {p.name}, which does not exist")
    return paths


def series_digest(series: Path = SERIES_FILE) -> str:
    """Two different stacks never get the same local version label."""
    h = hashlib.sha256()
    for name in read_series(series):
        h.update(name.encode() + b"\0" + (series.parent / name).read_bytes() + b"\0")
    return h.hexdigest()[:8]


def junit_outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """{test id: (passed | failed | skipped, first line of the failure)} from
    pytest's --junitxml. An error in setup or teardown fails the test."""
    if not junit.exists():
        raise StackError(f"pytest wrote no {junit}: see its log")
    result: dict[str, tuple[str, str]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        bad = [c for c in case if c.tag in ("failure", "error")]
        outcome = ("failed" if bad else
                   "skipped" if any(c.tag == "skipped" for c in case) else "passed")
        msg = ((bad[0].get("message") or "").splitlines() or [""])[0][:160] if bad else ""
        key = f"{case.get('classname')}::{case.get('name')}"
        if result.get(key, ("",))[0] != "failed":  # a test and its teardown error share a key
            result[key] = (outcome, msg)
    return result


def parser(tool: str, doc: str, offline: bool = False) -> argparse.ArgumentParser:
    """``python -m tools.<tool>``'s parser: the docstring's first paragraph
    describes it, the rest is the epilog."""
    head, _, rest = doc.partition("\n\n")
    ap = argparse.ArgumentParser(prog=f"python -m tools.{tool}", description=head, epilog=rest,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    if offline:
        ap.add_argument("--offline", action="store_true", default=offline_default(),
                        help="use the download cache only (also VLLM_EAGLE3_OFFLINE=1)")
    return ap


def say(tool: str, msg: str) -> None:
    print(f"[{tool}] {msg}", flush=True)


def run_main(tool: str, main) -> None:  # type: ignore[no-untyped-def]
    try:
        code = main()
    except StackError as e:
        print(f"[{tool}] error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    except KeyboardInterrupt:
        print(f"[{tool}] interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code or 0)
