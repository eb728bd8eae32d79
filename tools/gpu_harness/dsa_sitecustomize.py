# SPDX-License-Identifier: Apache-2.0
"""Installed by device_setup.sh as ``sitecustomize.py`` beside built kernels.

FlashMLA's sparse kernels (no obtainable pinned source) are not built by
kernels.py (docs/gpu-dsa.md). With ``EAGLE3_HARNESS_DSA=1`` their stand-ins
(dsa_ops.py, as ``vllm._gpu_harness_dsa_ops``) go into every Python process
vLLM starts, at interpreter start-up, after the built ``vllm._C`` has
registered its ops: dsa_ops leaves an op that already exists alone, so a
built kernel always wins over a stand-in."""

import os

if os.environ.get("EAGLE3_HARNESS_DSA") == "1":
    import vllm._C  # noqa: F401
    from vllm._gpu_harness_dsa_ops import install

    install()
