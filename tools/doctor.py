#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""``python tools/doctor.py [--drafter DIR [--target DIR]]`` from a clone:
``vllm-eagle3 doctor`` (tools/vllm_eagle3/doctor.py holds one check per
patch of the series)."""

import sys

# Run as a script, this file's directory (tools/) is first on sys.path, so
# the package imports as the installed command's top-level vllm_eagle3.
from vllm_eagle3.cli import run

if __name__ == "__main__":
    sys.exit(run(["doctor", *sys.argv[1:]], prog="python tools/doctor.py"))
