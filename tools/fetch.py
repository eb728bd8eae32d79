"""Fetch pinned upstream artifacts through pip's configured index, verified.

    python -m tools.fetch [KEY ...] [--offline] [--pin PIN]

KEY is an artifact key of the pin file (default: sdist). A file is used only
after its sha256 matches the pin. A cached file that does not match is moved
aside into ``<cache>/rejected/`` (never deleted) and fetched anew; a download
that does not match is kept there too and the tool stops with both digests.
With ``--offline`` (or VLLM_EAGLE3_OFFLINE=1) nothing is downloaded: a file
missing from the cache is an error that says how to get it.
"""

from __future__ import annotations

import argparse
import hashlib
import html.parser
import json
import os
import subprocess
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from tools._common import (
    Artifact,
    Pin,
    StackError,
    cache_dir,
    load_pin,
    run_main,
    say,
    sha256_file,
)

TOOL = "fetch"


def index_url() -> str:
    """The simple-API index pip itself would use: PIP_INDEX_URL, then pip's
    configuration, then pip's built-in default."""
    env = os.environ.get("PIP_INDEX_URL")
    if env:
        return env
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.rsplit(".", 1)[-1] == "index-url" and key.split(".")[0] in (
            "global",
            "download",
            "install",
            ":env:",
        ):
            return value.strip().strip("'\"")
    from pip._internal.models.index import PyPI  # pip's own default index

    return PyPI.simple_url


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: dict[str, str] = {}
        self._href: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self._href = dict(attrs).get("href")

    def handle_data(self, data: str) -> None:
        if self._href is not None and data.strip():
            self.links[data.strip()] = self._href

    def handle_endtag(self, tag: str) -> None:
        if tag == "a":
            self._href = None


def find_url(index: str, art: Artifact) -> str:
    """Resolve the artifact's download URL from the index's project page
    (PEP 691 JSON, falling back to the PEP 503 HTML page)."""
    page = urllib.parse.urljoin(index.rstrip("/") + "/", f"{art.project}/")
    # A file: index (a directory on disk, as pip accepts) serves index.html.
    fetch_url = page + "index.html" if page.startswith("file:") else page
    req = urllib.request.Request(
        fetch_url,
        headers={
            "Accept": "application/vnd.pypi.simple.v1+json, "
            "text/html;q=0.1"
        },
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            body = resp.read()
            ctype = resp.headers.get("Content-Type", "")
    except (urllib.error.URLError, OSError) as e:
        raise StackError(
            f"cannot reach pip's index for {art.project} ({e}). If this machine is "
            f"offline, put {art.filename} into the cache and use --offline."
        ) from None
    if "json" in ctype:
        files = {f["filename"]: f["url"] for f in json.loads(body)["files"]}
    else:
        parser = _Links()
        parser.feed(body.decode("utf-8", "replace"))
        files = parser.links
    if art.filename not in files:
        raise StackError(
            f"pip's index lists no file {art.filename} for project {art.project}"
        )
    return urllib.parse.urljoin(page, files[art.filename].split("#", 1)[0])


def _reject(cache: Path, path: Path, actual: str) -> Path:
    """Move a file that failed verification aside, keeping it for inspection."""
    dest_dir = cache / "rejected"
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / f"{path.name}.sha256-{actual[:16]}"
    os.replace(path, dest)
    return dest


def download(url: str, dest: Path, expected: str) -> str:
    """Stream to a temp file beside ``dest``; return the digest of what came.
    The temp file becomes ``dest`` only when the digest matches."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=120) as r:
            while block := r.read(1 << 22):
                h.update(block)
                out.write(block)
        actual = h.hexdigest()
        if actual == expected:
            os.replace(tmp, dest)
        else:
            _reject(dest.parent, Path(tmp), actual)
        return actual
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def ensure(art: Artifact, *, offline: bool, cache: Path | None = None) -> Path:
    """Return the path of the verified artifact in the cache."""
    cache = cache or cache_dir()
    path = cache / art.filename
    if path.exists():
        actual = sha256_file(path)
        if actual == art.sha256:
            say(TOOL, f"verified {art.filename} (sha256 {actual[:16]}...) in {cache}")
            return path
        moved = _reject(cache, path, actual)
        say(
            TOOL,
            f"cached {art.filename} has sha256 {actual}, pin says {art.sha256}: "
            f"not used, moved aside to {moved}",
        )
    if offline:
        raise StackError(
            f"offline, and {art.filename} (sha256 {art.sha256}) is not in the cache "
            f"{cache}. On a machine with access to pip's index run "
            f"`python -m tools.fetch {art.key}` (or `pip download --no-deps "
            f"{art.project}=={art.filename.split('-')[1]}` with the matching "
            f"platform) and copy the file into {cache}; or drop --offline / "
            f"VLLM_EAGLE3_OFFLINE."
        )
    url = find_url(index_url(), art)
    say(TOOL, f"downloading {art.filename} through pip's index")
    actual = download(url, path, art.sha256)
    if actual != art.sha256:
        raise StackError(
            f"downloaded {art.filename} has sha256 {actual}, but the pin expects "
            f"{art.sha256}. The file was not used; it is kept under "
            f"{cache / 'rejected'} for inspection. Check pip's index/proxy, or the "
            f"pin file if upstream re-published the file."
        )
    say(TOOL, f"fetched and verified {art.filename} (sha256 {actual[:16]}...)")
    return path


def ensure_many(pin: Pin, keys: list[str], *, offline: bool) -> dict[str, Path]:
    return {k: ensure(pin.artifact(k), offline=offline) for k in keys}


def offline_default() -> bool:
    return os.environ.get("VLLM_EAGLE3_OFFLINE", "") not in ("", "0")


def main() -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tools.fetch",
        description="Fetch pinned vLLM artifacts through pip's index and verify "
        "their sha256 against pin.toml.",
    )
    ap.add_argument("keys", nargs="*", default=["sdist"], help="artifact keys (default: sdist)")
    ap.add_argument("--offline", action="store_true", default=offline_default(),
                    help="use the cache only (also VLLM_EAGLE3_OFFLINE=1)")
    ap.add_argument("--pin", type=Path, default=None, help="pin file (default: pin.toml)")
    ap.add_argument("--list", action="store_true", help="list the pinned artifacts and exit")
    args = ap.parse_args()
    pin = load_pin(args.pin)
    if args.list:
        for a in pin.artifacts.values():
            print(f"{a.key:20} {a.filename}  sha256={a.sha256}")
        return 0
    for key, path in ensure_many(pin, args.keys, offline=args.offline).items():
        print(f"{key}: {path}")
    return 0


if __name__ == "__main__":
    run_main(TOOL, main)
