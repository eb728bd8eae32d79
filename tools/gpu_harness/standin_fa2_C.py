# SPDX-License-Identifier: Apache-2.0
"""GPU-harness stand-in for ``vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so``
(installed as ``vllm/vllm_flash_attn/_vllm_fa2_C.py``).

The wheel's ``vllm_flash_attn/flash_attn_interface.py`` imports this module
to decide whether FlashAttention-2 is available, then calls
``torch.ops._vllm_fa2_C.varlen_fwd``. The MLA prefill on Hopper reaches that
call (v0.16.0 routes MLA prefill to FlashInfer/cuDNN/TRT-LLM only on
Blackwell). Importing ``vllm._C`` registers the torch implementation of
``varlen_fwd`` with all the other harness ops; FA3 stays unavailable, so
vLLM uses the FA2 code paths (FLASH_ATTN_MLA, which needs FA3, is not
selected; MLA layers get TRITON_MLA, whose decode kernel is Triton).
"""

import vllm._C  # noqa: F401  (registers _vllm_fa2_C::varlen_fwd)
