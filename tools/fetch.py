"""Fetch pinned upstream artifacts through pip's configured index, verified.

    python -m tools.fetch [KEY ...] [--offline] [--pin PIN]

KEY is an artifact key of the pin file (default: sdist). A file is used only
after its sha256 matches the pin. A cached file that does not match is moved
aside into ``<cache>/rejected/`` (never deleted) and fetched anew; a download
that does not match is kept there too and the tool stops with both digests.
With ``--offline`` (or VLLM_EAGLE3_OFFLINE=1) nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import html.parser
import os
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

from tools._common import (
    Artifact,
    StackError,
    cache_dir,
    load_pin,
    offline_default,
    parser,
    run_main,
    say,
    sha256_file,
)

TOOL = "fetch"
__all__ = ["ensure", "offline_default"]  # the GPU harness imports both from here


def index_url() -> str:
    """The simple-API index pip itself would use: PIP_INDEX_URL, then pip's
    configuration, then pip's built-in default."""
    if env := os.environ.get("PIP_INDEX_URL"):
        return env
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                         capture_output=True, text=True).stdout
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.rsplit(".", 1)[-1] == "index-url" and \
                key.split(".")[0] in ("global", "download", "install", ":env:"):
            return value.strip().strip("'\"")
    from pip._internal.models.index import PyPI

    return PyPI.simple_url


class _Links(html.parser.HTMLParser):
    """A PEP 503 page's {file name: href}."""

    def __init__(self) -> None:
        super().__init__()
        self.links: dict[str, str] = {}
        self._href: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self._href = dict(attrs).get("href")

    def handle_endtag(self, tag: str) -> None:
        if tag == "a":
            self._href = None

    def handle_data(self, data: str) -> None:
        if self._href is not None and data.strip():
            self.links[data.strip()] = self._href


def find_url(index: str, art: Artifact) -> str:
    """The artifact's URL from the index's PEP 503 project page (the format
    every simple index serves)."""
    page = urllib.parse.urljoin(index.rstrip("/") + "/", f"{art.project}/")
    # A file: index (a directory on disk, as pip accepts) serves index.html.
    try:
        with urllib.request.urlopen(page + "index.html" if page.startswith("file:") else page,
                                    timeout=60) as resp:
            body = resp.read().decode("utf-8", "replace")
    except OSError as e:  # URLError included
        raise StackError(f"cannot reach pip's index for {art.project} ({e}). If this machine "
                         f"is offline, put {art.filename} into the cache and use --offline.") \
            from None
    links = _Links()
    links.feed(body)
    if art.filename not in links.links:
        raise StackError(f"pip's index lists no file {art.filename} for project {art.project}")
    return urllib.parse.urljoin(page, links.links[art.filename].split("#", 1)[0])


def _reject(cache: Path, path: Path, actual: str) -> Path:
    """Move a file that failed verification aside, kept for inspection."""
    dest = cache / "rejected" / f"{path.name}.sha256-{actual[:16]}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(path, dest)
    return dest


def download(url: str, dest: Path, expected: str) -> str:
    """Stream to a temp file beside ``dest``, which it becomes only when its
    digest matches; return the digest of what came."""
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
    """The path of the verified artifact in the cache."""
    cache = cache or cache_dir()
    path = cache / art.filename
    if path.exists():
        actual = sha256_file(path)
        if actual == art.sha256:
            say(TOOL, f"verified {art.filename} (sha256 {actual[:16]}...) in {cache}")
            return path
        moved = _reject(cache, path, actual)
        say(TOOL, f"cached {art.filename} has sha256 {actual}, pin says {art.sha256}: "
            f"not used, moved aside to {moved}")
    if offline:
        raise StackError(
            f"offline, and {art.filename} (sha256 {art.sha256}) is not in the cache "
            f"{cache}. On a machine with access to pip's index run "
            f"`python -m tools.fetch {art.key}` (or `pip download --no-deps "
            f"{art.project}=={art.filename.split('-')[1]}` with the matching "
            f"platform) and copy the file into {cache}; or drop --offline / "
            f"VLLM_EAGLE3_OFFLINE.")
    url = find_url(index_url(), art)
    say(TOOL, f"downloading {art.filename} through pip's index")
    actual = download(url, path, art.sha256)
    if actual != art.sha256:
        raise StackError(
            f"downloaded {art.filename} has sha256 {actual}, but the pin expects "
            f"{art.sha256}. The file was not used; it is kept under {cache / 'rejected'} "
            "for inspection. Check pip's index/proxy, or the pin file if upstream "
            "re-published the file.")
    say(TOOL, f"fetched and verified {art.filename} (sha256 {actual[:16]}...)")
    return path


def main() -> int:
    ap = parser("fetch", __doc__, offline=True)
    ap.add_argument("keys", nargs="*", default=["sdist"], help="artifact keys (default: sdist)")
    ap.add_argument("--pin", type=Path, default=None, help="pin file (default: pin.toml)")
    args = ap.parse_args()
    pin = load_pin(args.pin)
    for key in args.keys:
        print(f"{key}: {ensure(pin.artifact(key), offline=args.offline)}")
    return 0


if __name__ == "__main__":
    run_main(TOOL, main)
