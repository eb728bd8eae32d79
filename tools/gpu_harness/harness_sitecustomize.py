# SPDX-License-Identifier: Apache-2.0
"""Installed by device_setup.sh as ``sitecustomize.py`` beside built kernels:
the harness's two switches, each off unless its variable is 1.

``EAGLE3_HARNESS_DSA=1``: FlashMLA's sparse kernels and DeepGEMM's indexer
logits (no registry release at v0.16.0's pins) are not built by kernels.py
(docs/gpu-dsa.md). Their stand-ins (dsa_ops.py, as
``vllm._gpu_harness_dsa_ops``) go into every Python process vLLM starts, at
interpreter start-up, after the built ``vllm._C`` has registered its ops:
dsa_ops leaves an op that already exists alone, so a built kernel always wins
over a stand-in.

``EAGLE3_HARNESS_FI_PREFILL=1``: MLA prefill on Hopper through FlashInfer
(fi_prefill.py, as ``_eagle3_fi_prefill``), for a build without
FlashAttention-3."""

import os

if os.environ.get("EAGLE3_HARNESS_DSA") == "1":
    import vllm._C  # noqa: F401
    from vllm._gpu_harness_dsa_ops import install

    install()

if os.environ.get("EAGLE3_HARNESS_FI_PREFILL") == "1":
    from _eagle3_fi_prefill import install as install_fi_prefill

    install_fi_prefill()
