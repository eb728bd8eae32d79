# SPDX-License-Identifier: Apache-2.0
"""Helpers for the tooling tests (importable: tests/tools is on sys.path)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_tool(module: str, *args: str, env: dict[str, str] | None = None,
             cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess[str]:
    """Run a tool the way a user does: ``python -m tools.X`` from the repo."""
    return subprocess.run([sys.executable, "-m", f"tools.{module}", *args], cwd=cwd,
                          capture_output=True, text=True, env={**os.environ, **(env or {})})


def write_mail(*, subject: str = "[Model] Add foo", body: str = "Why foo.\n",
               trailers: list[str], author: str) -> str:
    """A mail shaped like tools.export_series writes them (format-patch
    --keep-subject --no-stat --no-signature --zero-commit), adding foo.txt."""
    message = body + ("\n" if body else "") + "".join(f"{t}\n" for t in trailers)
    return ("From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
            f"From: {author}\nDate: Sun, 29 Nov 2026 10:31:44 +0000\n"
            f"Subject: {subject}\n\n{message}\n"
            "diff --git a/foo.txt b/foo.txt\nnew file mode 100644\n"
            "index 0000000000000000000000000000000000000000..257cc5642cb1a054f08cc83f2d943e56fd3ebe99\n"
            "--- /dev/null\n+++ b/foo.txt\n@@ -0,0 +1 @@\n+foo\n")
