# SPDX-License-Identifier: Apache-2.0
"""GPU-harness stand-in for ``vllm/_C.abi3.so`` (installed as ``vllm/_C.py``).

The official vLLM 0.16.0 CUDA extension is built for torch 2.9.1 / CUDA 12
and cannot load on the lent device (torch 2.11 / CUDA 13). vLLM imports
``vllm._C`` from ``vllm.platforms.cuda`` in every process it starts (engine
core, model-inspection subprocess), so registering the harness's torch
implementations here makes them visible wherever vLLM calls
``torch.ops._C.*`` / ``torch.ops._moe_C.*``.

Ops not registered here are not stubbed: calling one fails with torch's
"no attribute" error, naming the op.
"""

from vllm._gpu_harness_ops import OP_NAMES, register

HARNESS_OPS = register()
assert set(HARNESS_OPS) <= set(OP_NAMES)

if __import__("os").environ.get("EAGLE3_HARNESS_DSA") == "1":
    # GLM-5 / DeepSeek-V3.2 sparse attention (dsa_ops.py, docs/gpu-dsa.md).
    # Opt-in: installing it also makes DeepGEMM and dense FlashMLA look
    # available, which the dense MLA runs must not see.
    from vllm._gpu_harness_dsa_ops import install as install_dsa_ops

    DSA_OPS = install_dsa_ops()
