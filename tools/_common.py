"""Shared pieces of the stack's tools: the pin file, the cache, the series.

Every tool reads the pin through :func:`load_pin`; nothing else in the
repository repeats artifact names or digests.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PIN = REPO_ROOT / "pin.toml"
PATCHES_DIR = REPO_ROOT / "patches"
SERIES_FILE = PATCHES_DIR / "series"

# The identity that owns commits the tools make themselves (the base commit of
# an imported tree). Fixed so that an import is reproducible.
TOOL_IDENT = ("vLLM EAGLE-3 Stack", "eagle3-stack@users.noreply.github.com")
BASE_DATE = "2026-01-01T00:00:00+00:00"


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
        try:
            return self.artifacts[key]
        except KeyError:
            known = ", ".join(sorted(self.artifacts))
            raise StackError(
                f"{self.path} pins no artifact {key!r} (pinned: {known})"
            ) from None


def load_pin(path: Path | None = None) -> Pin:
    path = path or Path(os.environ.get("VLLM_EAGLE3_PIN", DEFAULT_PIN))
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise StackError(f"pin file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise StackError(f"pin file {path} is not valid TOML: {e}") from None
    try:
        up = data["upstream"]
        artifacts = {
            key: Artifact(key, a["project"], a["filename"], a["sha256"].lower())
            for key, a in data["artifacts"].items()
        }
        return Pin(
            path=path,
            project=up["project"],
            version=up["version"],
            tag=up["tag"],
            artifacts=artifacts,
            local_label=data.get("build", {}).get("local_label", "stack"),
            cpu_env=dict(data.get("cpu_env", {})),
        )
    except KeyError as e:
        raise StackError(f"pin file {path} lacks the field {e}") from None


def cache_dir() -> Path:
    """Where verified downloads live: per user, like pip's own cache."""
    env = os.environ.get("VLLM_EAGLE3_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "vllm-eagle3-stack"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_series(series: Path = SERIES_FILE) -> list[str]:
    """Patch names in apply order. Blank lines and ``#`` comments are skipped;
    anything after the name on a line (quilt's per-patch options) is refused,
    because the build applies every patch the same strict way."""
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
                "every patch with -p1 and no fuzz, so list the file name alone"
            )
        names.append(line)
    return names


def series_digest(series: Path = SERIES_FILE) -> str:
    """A short digest over the series and its patches, in order: two different
    stacks never get the same local version label."""
    h = hashlib.sha256()
    for name in read_series(series):
        h.update(name.encode() + b"\0")
        h.update((series.parent / name).read_bytes())
        h.update(b"\0")
    return h.hexdigest()[:8]


def junit_outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """{test id: (passed | failed | skipped, first line of the failure)} from
    pytest's own --junitxml file. An error in setup or teardown fails the test."""
    import xml.etree.ElementTree as ET

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
