"""python -m vllm_eagle3: the same as the vllm-eagle3 command."""

import sys

from .cli import run

sys.exit(run())
