# SPDX-License-Identifier: Apache-2.0
"""tools/gpu_harness/harness_sitecustomize.py, as device_setup.sh installs it beside
built kernels: in a fresh interpreter with EAGLE3_HARNESS_DSA=1, the DSA
stand-ins are installed after vllm._C, and an op vllm._C registered, or a
real deep_gemm on the path, stays its own. Runs on CPU: a stand-in vllm
package plays the built one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from gpu_e2e_helpers import REPO_ROOT

HARNESS = REPO_ROOT / "tools" / "gpu_harness"

# A built library that also registers an op dsa_ops stands in for, as a
# TORCH_LIBRARY does on import: the collision is made here on purpose (the
# real vllm._C has no _flashmla_C op), so the stand-in must lose to it.
_BUILT_C = '''
import torch
lib = torch.library.Library("_flashmla_C", "DEF")
lib.define("sparse_prefill_fwd(Tensor q, Tensor kv, Tensor indices, float sm_scale, int d_v, "
           "Tensor? attn_sink, Tensor? topk_length) -> Tensor[]")
def built(*args):
    raise RuntimeError("the built kernel ran")
lib.impl("sparse_prefill_fwd", built, "CPU")
'''

_PROBE = '''
import json, sys, torch
out = {"deep_gemm": "deep_gemm" in sys.modules, "sparse_decode": False, "sparse_prefill": None}
try:
    out["sparse_decode"] = hasattr(torch.ops._flashmla_C, "sparse_decode_fwd")
except Exception:
    pass
q, kv = torch.zeros((1, 64, 576), dtype=torch.bfloat16), torch.zeros((1, 1, 576), dtype=torch.bfloat16)
try:
    torch.ops._flashmla_C.sparse_prefill_fwd(q, kv, torch.zeros((1, 1, 1), dtype=torch.int32),
                                             1.0, 512, None, None)
    out["sparse_prefill"] = "stand-in ran"
except AttributeError:
    out["sparse_prefill"] = "absent"
except Exception as e:
    out["sparse_prefill"] = str(e)
print(json.dumps(out))
'''


def _site(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    (site / "vllm" / "_C.py").write_text(_BUILT_C)
    shutil.copy(HARNESS / "dsa_ops.py", site / "vllm" / "_gpu_harness_dsa_ops.py")
    shutil.copy(HARNESS / "harness_sitecustomize.py", site / "sitecustomize.py")
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
    # No real deep_gemm here: the stand-in takes its name.
    assert got["deep_gemm"] and got["sparse_decode"]
    # dsa_ops has its own sparse_prefill_fwd; the built one stays.
    assert got["sparse_prefill"] == "the built kernel ran"


def test_a_real_deep_gemm_wins_over_the_stand_in(tmp_path: Path):
    site = _site(tmp_path)
    (site / "deep_gemm").mkdir()
    (site / "deep_gemm" / "__init__.py").write_text('"""the real one"""')
    env = {k: v for k, v in os.environ.items() if k != "EAGLE3_HARNESS_DSA"}
    env.update(PYTHONPATH=os.pathsep.join([str(site), *sys.path]), EAGLE3_HARNESS_DSA="1")
    r = subprocess.run([sys.executable, "-c", "import deep_gemm; print(deep_gemm.__doc__)"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "the real one"


def test_nothing_is_installed_without_the_switch(tmp_path: Path):
    got = _probe(_site(tmp_path), dsa=False)
    assert got == {"deep_gemm": False, "sparse_decode": False, "sparse_prefill": "absent"}
