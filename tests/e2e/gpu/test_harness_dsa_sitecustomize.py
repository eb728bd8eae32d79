# SPDX-License-Identifier: Apache-2.0
"""tools/gpu_harness/dsa_sitecustomize.py, as device_setup.sh installs it beside
built kernels: in a fresh interpreter with EAGLE3_HARNESS_DSA=1, the DSA
stand-ins are installed after vllm._C, and an op vllm._C registered stays
its own. Runs on CPU: a stand-in vllm package plays the built one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from gpu_e2e_helpers import REPO_ROOT

HARNESS = REPO_ROOT / "tools" / "gpu_harness"

# What a built vllm._C does on import for the op checked here: define and
# implement it in its own namespace (TORCH_LIBRARY in csrc/torch_bindings.cpp).
_BUILT_C = '''
import torch
lib = torch.library.Library("_C_cache_ops", "DEF")
lib.define("concat_and_cache_mla(Tensor kv_c, Tensor k_pe, Tensor! kv_cache, Tensor slot_mapping, "
           "str kv_cache_dtype, Tensor scale) -> ()")
def built(*args):
    raise RuntimeError("the built kernel ran")
lib.impl("concat_and_cache_mla", built, "CPU")
'''

_PROBE = '''
import json, sys, torch
out = {"deep_gemm": "deep_gemm" in sys.modules, "flashmla_sparse": False, "cache_op": None}
try:
    out["flashmla_sparse"] = hasattr(torch.ops._flashmla_C, "sparse_prefill_fwd")
except Exception:
    pass
try:
    t = torch.zeros(1)
    torch.ops._C_cache_ops.concat_and_cache_mla(t, t, t, t.long(), "auto", t)
    out["cache_op"] = "stand-in ran"
except RuntimeError as e:
    out["cache_op"] = str(e)
except AttributeError:
    out["cache_op"] = "absent"
print(json.dumps(out))
'''


def _site(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    (site / "vllm" / "_C.py").write_text(_BUILT_C)
    shutil.copy(HARNESS / "dsa_ops.py", site / "vllm" / "_gpu_harness_dsa_ops.py")
    shutil.copy(HARNESS / "dsa_sitecustomize.py", site / "sitecustomize.py")
    return site


def _probe(site: Path, dsa: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "EAGLE3_HARNESS_DSA"}
    env["PYTHONPATH"] = os.pathsep.join([str(site), *sys.path])
    if dsa:
        env["EAGLE3_HARNESS_DSA"] = "1"
    r = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_dsa_stand_ins_join_built_kernels_in_every_interpreter(tmp_path: Path):
    got = _probe(_site(tmp_path), dsa=True)
    assert got["deep_gemm"] and got["flashmla_sparse"]
    # dsa_ops has its own concat_and_cache_mla; the built one stays.
    assert got["cache_op"] == "the built kernel ran"


def test_nothing_is_installed_without_the_switch(tmp_path: Path):
    got = _probe(_site(tmp_path), dsa=False)
    assert got == {"deep_gemm": False, "flashmla_sparse": False, "cache_op": "absent"}
