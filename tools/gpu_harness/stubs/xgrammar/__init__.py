# SPDX-License-Identifier: Apache-2.0
"""Import-only placeholder for xgrammar (structured output), GPU harness only.

vLLM 0.16's ``v1/structured_output/backend_xgrammar.py`` evaluates
``xgr.GrammarMatcher`` in a dataclass annotation when the module is imported,
so ``xgrammar`` must be importable even when no request asks for structured
output. The real package (35 MB) does not fit the device's carry budget next
to the rest; the harness runs no structured-output request. Every attribute is
a placeholder class that refuses to be used, so a structured-output request
fails loudly instead of silently doing nothing.
"""

__version__ = "0.0.0+gpu-harness-placeholder"


class _Unavailable:
    _name = "xgrammar"

    def __init__(self, *args, **kwargs):
        raise RuntimeError(
            f"{self._name}: structured output (xgrammar) is not available in "
            "the vLLM GPU harness (tools/gpu_harness)"
        )

    def __class_getitem__(cls, item):
        return cls


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return type(name, (_Unavailable,), {"_name": f"xgrammar.{name}"})
