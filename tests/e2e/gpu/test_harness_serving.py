# SPDX-License-Identifier: Apache-2.0
"""CPU tests of test_eagle3_serving.py's helpers (serving_helpers.py): the
sampling statistics and their negative control, top-p as vLLM defines it,
the spec-decode counters read both ways vLLM exposes them, and the request
generators against the limits the GPU cases rely on. Run in CI."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

import serving_helpers as sh

# --- sampling statistics ---------------------------------------------------


def test_statistic_equals_pearson_for_identical_positions():
    """With one distribution at every position the generalised statistic is
    Pearson's chi-square, and the chi-square tail with 2 degrees of freedom
    is exp(-x / 2): both written out independently here."""
    m = np.array([0.6, 0.3, 0.1])
    rng = np.random.default_rng(1)
    bins = rng.choice(3, size=500, p=[0.55, 0.33, 0.12])
    t = sh.sampling_test(bins, np.tile(m, (500, 1)))
    obs = np.bincount(bins, minlength=3)
    pearson = float((((obs - 500 * m) ** 2) / (500 * m)).sum())
    assert t.statistic == pytest.approx(pearson, rel=1e-9)
    assert t.dof == 2
    assert t.p_value == pytest.approx(math.exp(-pearson / 2), rel=1e-9)
    assert t.observed == obs.tolist()


def test_detectable_shift_is_the_normal_approximation():
    m = np.tile([0.9, 0.05, 0.05], (10000, 1))
    t = sh.sampling_test(np.zeros(10000, dtype=int), m, alpha=1e-3)
    z = 3.2905267314919255 + 1.6448536269514722  # alpha 1e-3 two-sided, power 0.95
    assert t.detectable_top1_shift == pytest.approx(z * math.sqrt(10000 * 0.09) / 10000, rel=1e-6)


def _toy(v: int = 16, seed: int = 0):
    """A next-token model over v tokens that depends on the last token, a
    drafter that agrees with its argmax two times in three."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(v, v)) * 1.5
    wrong = rng.integers(0, v, size=v)
    draft = [int(np.argmax(w[i])) if i % 3 else int(wrong[i]) for i in range(v)]

    def q_fn(seq):
        return sh.nucleus(w[seq[-1]], 0.8, 0.95)[0]

    return q_fn, (lambda seq: draft[seq[-1]]), v


def _bins(q_fn, seqs):
    bins, masses = [], []
    for prefix, toks in seqs:
        seq = list(prefix)
        for tok in toks:
            b, m = sh.rank_bins(q_fn(seq), tok)
            bins.append(b)
            masses.append(m)
            seq.append(tok)
    return bins, masses


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_right_rule_passes_and_accepting_every_draft_fails(seed):
    """Speculative sampling with vLLM's rule (accept d with probability q(d),
    else resample from q without d) passes; accepting every draft, the
    broken rule the GPU test patches in, fails with 6,000 tokens."""
    q_fn, draft, v = _toy(seed=seed)
    rng = np.random.default_rng(100 + seed)
    res = {}
    for broken in (False, True):
        seqs = [([i % v], sh.speculative_sample(rng, q_fn, draft, [i % v], 100, 3, accept_all=broken))
                for i in range(60)]
        res[broken] = sh.sampling_test(*_bins(q_fn, seqs), alpha=1e-3)
    assert res[False].p_value >= 1e-3, res[False]
    assert res[True].p_value < 1e-9, res[True]


def test_false_alarm_rate_under_the_null():
    """Tokens drawn from the reference itself: p < 0.05 in about 5% of 200
    runs (binomial bounds: 2 to 20)."""
    q_fn, _, v = _toy(seed=5)
    rng = np.random.default_rng(7)
    low = 0
    for _ in range(200):
        bins, masses = [], []
        for i in range(10):
            seq = [i % v]
            for _ in range(30):
                q = q_fn(seq)
                tok = int(rng.choice(v, p=q))
                b, m = sh.rank_bins(q, tok)
                bins.append(b)
                masses.append(m)
                seq.append(tok)
        low += sh.sampling_test(bins, masses).p_value < 0.05
    assert 2 <= low <= 20, low


def test_nucleus_keeps_what_vllm_keeps():
    """serving_helpers.nucleus (float64) against vLLM's own apply_top_k_top_p
    on random logits: the same tokens kept, the same renormalised mass."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 320, generator=g, dtype=torch.float64) * 3
    temperature, top_p = 0.8, 0.95
    masked = apply_top_k_top_p((logits / temperature).clone(), None, torch.full((64,), top_p, dtype=torch.float64))
    ref = masked.softmax(-1)
    for row in range(64):
        q, keep = sh.nucleus(logits[row].numpy(), temperature, top_p)
        assert keep.tolist() == torch.isfinite(masked[row]).tolist()
        np.testing.assert_allclose(q, ref[row].numpy(), rtol=1e-9, atol=1e-15)


def test_rank_bins():
    b, m = sh.rank_bins(np.array([0.1, 0.6, 0.0, 0.3]), 3)
    assert b == 1 and m.tolist() == pytest.approx([0.6, 0.3, 0.1])
    assert sh.rank_bins(np.array([0.1, 0.6, 0.0, 0.3]), 0)[0] == 2
    # Ties go to the lower token id.
    assert sh.rank_bins(np.array([0.4, 0.4, 0.2]), 1)[0] == 1


# --- counters ----------------------------------------------------------------


@pytest.fixture
def spec_prom():
    """vLLM's own spec-decode Prometheus metrics, fed known drafts."""
    import prometheus_client
    from vllm.v1.metrics.loggers import unregister_vllm_metrics
    from vllm.v1.spec_decode.metrics import SpecDecodingProm, SpecDecodingStats

    unregister_vllm_metrics()

    class Spec:
        num_speculative_tokens = 3

    prom = SpecDecodingProm(Spec(), ["model_name", "engine"], {0: ["m", "0"]})
    stats = SpecDecodingStats.new(3)
    for accepted in (0, 1, 3, 3, 2, 0, 1):
        stats.observe_draft(3, accepted)
    prom.observe(stats, 0)
    yield stats, prometheus_client
    unregister_vllm_metrics()


def test_spec_counters_from_both_readers(spec_prom):
    """The server's /metrics text and LLM.get_metrics() give the same
    counters, equal to the drafts fed in."""
    from vllm.v1.metrics.reader import get_metrics_snapshot

    stats, prometheus_client = spec_prom
    text = prometheus_client.generate_latest().decode()
    a = sh.counters_from_prometheus(text)
    b = sh.counters_from_llm_metrics(get_metrics_snapshot())
    for c in (a, b):
        assert c["num_drafts"] == 7 and c["num_draft_tokens"] == 21 and c["num_accepted_tokens"] == 10
        assert c["accepted_per_position"] == stats.num_accepted_tokens_per_pos == [5, 3, 2]
        assert sh.spec_counter_problems(sh.delta(sh._empty(), c), 3) == []


def test_spec_counter_problems_catch_each_inconsistency():
    good = {"num_drafts": 10, "num_draft_tokens": 30, "num_accepted_tokens": 12,
            "accepted_per_position": [6, 4, 2]}
    assert sh.spec_counter_problems(good, 3) == []
    bad = [
        {**good, "num_draft_tokens": 29},
        {**good, "num_accepted_tokens": 31, "accepted_per_position": [11, 10, 10]},
        {**good, "accepted_per_position": [6, 4, 3]},  # sum 13 != 12
        {**good, "accepted_per_position": [4, 6, 2]},  # later position above earlier
        {**good, "accepted_per_position": [12, 0, 0], "num_drafts": 10},  # 12 > 10 drafts
        {**good, "accepted_per_position": [6, 6]},
    ]
    for b in bad:
        assert sh.spec_counter_problems(b, 3), b


def test_delta_and_derived_rates():
    before, after = sh._empty(), sh._empty()
    after.update(prefix_cache_queries=1000, prefix_cache_hits=850, num_drafts=10, num_accepted_tokens=25,
                 accepted_per_position=[10, 9, 6], kv_cache_usage=0.25)
    before.update(prefix_cache_queries=100, prefix_cache_hits=50)
    d = sh.delta(before, after)
    assert d["prefix_cache_hit_rate"] == pytest.approx(800 / 900)
    assert d["mean_acceptance_length"] == pytest.approx(3.5)
    assert d["kv_cache_usage"] == 0.25


def test_iteration_details_reads_the_line_vllm_logs():
    """The line comes from vLLM's own EngineCore.log_iteration_details (what
    the server logs with --enable-logging-iteration-details), for a step with
    a new request's chunk, a later chunk of another, and a decode."""
    import logging
    from types import SimpleNamespace

    from vllm.v1.engine.core import EngineCore

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    log = logging.getLogger("vllm.v1.engine.core")
    handler, level = Keep(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        core = SimpleNamespace(vllm_config=SimpleNamespace(
            observability_config=SimpleNamespace(enable_logging_iteration_details=True)))
        for chunk in (2044, 2048):
            sched = SimpleNamespace(
                num_scheduled_tokens={"new": chunk, "chunked": 2048 - chunk - 4 if chunk < 2048 else 0,
                                      "decoding": 4},
                scheduled_new_reqs=[SimpleNamespace(req_id="new")],
                scheduled_cached_reqs=SimpleNamespace(is_context_phase=lambda r: r == "chunked"))
            with EngineCore.log_iteration_details(core, sched):
                pass
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    text = "INFO 12-03 22:31:35 [core.py:365] " + "\nINFO [core.py:365] ".join(records) + "\n"
    steps = sh.iteration_details(text)
    assert [(s["iteration"], s["context_requests"], s["context_tokens"], s["generation_requests"],
             s["generation_tokens"]) for s in steps] == [(0, 2, 2044, 1, 4), (1, 2, 2048, 1, 4)]
    assert sh.iteration_details("no step lines here") == []


# --- requests ------------------------------------------------------------------


def test_workloads_fit_the_cases():
    import test_eagle3_serving as t

    pw = sh.prefix_workload()
    system = pw.prompts[0][: pw.info["system_prompt_tokens"]]
    assert len(system) >= 1500 and all(p[: len(system)] == system for p in pw.prompts)
    assert len({tuple(p) for p in pw.prompts}) == len(pw.prompts)
    # Even with 64-token blocks and the warm request missing, >= 0.8 can be hit.
    cached = (len(system) // 64) * 64 * (len(pw.prompts) - 1)
    assert cached / sum(len(p) for p in pw.prompts) >= t.MIN_HIT_RATE
    lw = sh.long_workload()
    assert all(8192 <= len(p) and len(p) + m + t.K <= min(t.MAX_MODEL_LEN, t.SERVING_KV_TOKENS)
               for p, m in zip(lw.prompts, lw.max_tokens))
    assert all(-(-len(p) // t.SERVING_BATCHED_TOKENS) >= 4 for p in lw.prompts)
    prw = sh.preemption_workload()
    assert sh.kv_tokens_needed(prw, t.K) >= 1.5 * t.SERVING_KV_TOKENS
    assert max(len(p) + m for p, m in zip(prw.prompts, prw.max_tokens)) < t.SERVING_KV_TOKENS // 4
    # The trained pairs' language: t[i+1] = f(t[i-1]) except for noise.
    f = sh.skip_rule()
    s = lw.prompts[0]
    assert sum(s[i + 1] == f[s[i - 1]] for i in range(1, len(s) - 1)) / (len(s) - 2) > 0.8


def test_soak_requests_mix_everything():
    import test_eagle3_serving as t

    rng, f = random.Random(0), sh.skip_rule()
    system = sh.rule_sequence(rng, f, 1536)
    qs = [sh.soak_request(rng, system, f) for _ in range(2000)]
    assert {q.temperature for q in qs} == {0.0, 0.8} and {q.n for q in qs} == {1, 2}
    assert any(q.stop for q in qs) and any(q.disconnect_after for q in qs)
    assert sum(q.prompt[:1536] == system for q in qs) > 500
    assert any(len(q.prompt) >= 3000 for q in qs)
    assert {q.max_tokens for q in qs} == {16, 64, 128, 256}
    assert all(len(q.prompt) + q.max_tokens + t.K <= t.MAX_MODEL_LEN for q in qs)
    assert all(q.n == 1 for q in qs if q.temperature == 0.0)


def test_server_args_set_every_condition(tmp_path):
    import test_eagle3_serving as t

    pair = t.Pair("kimi", "kimi-k25-int4", tmp_path / "t", tmp_path / "v", tmp_path / "d", "mla", {}, tmp_path)
    args = t.server_args(pair, 96)
    joined = " ".join(args)
    for flag in ("--enable-prefix-caching", "--enable-chunked-prefill", "--max-num-batched-tokens 2048",
                 "--num-gpu-blocks-override 96", "--limit-mm-per-prompt", '"method": "eagle3"'):
        assert flag in joined, flag
    assert "--enforce-eager" not in args  # production: compiled, CUDA graphs
    assert "--num-gpu-blocks-override" not in t.server_args(pair, None)
    assert t._blocks_for(12288, {"block_size": 64, "kv_cache_groups": [["a"], ["b"]]}) == 384


# --- the MLA drafter trainer (serving_pairs.py) ---------------------------------


def _mla_drafter(tmp_path):
    import json

    from safetensors.torch import load_file

    import serving_pairs as sp

    d = sp.write_mla_drafter(tmp_path / "mla_drafter", {})  # smoke geometry, float32
    return d, json.loads((d / "config.json").read_text()), load_file(str(d / "model.safetensors"))


def test_mla_draft_layer_equals_the_checked_reference(tmp_path):
    """serving_pairs' MLA draft layer (what the Kimi pair's drafter is
    trained with) against tests/models/test_deepseek_eagle3_drafter.py's
    written-out draft step, which that file checks against vLLM's own
    Eagle3DeepseekV2 drafter: YaRN rope and temperature included."""
    import importlib.util

    import serving_pairs as sp
    from gpu_e2e_helpers import REPO_ROOT

    spec = importlib.util.spec_from_file_location(
        "mla_drafter_reference", REPO_ROOT / "tests" / "models" / "test_deepseek_eagle3_drafter.py")
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    _, cfg, w = _mla_drafter(tmp_path)
    assert cfg["rope_scaling"]["type"] == "yarn"
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(cfg["vocab_size"], cfg["hidden_size"], generator=g)
    ids = torch.randint(0, cfg["vocab_size"], (9,), generator=g)
    fused = torch.randn(9, cfg["hidden_size"], generator=g)
    pos = torch.arange(9) + 5
    with torch.no_grad():
        pre, _, _, _ = sp.mla_drafter_class()(cfg, w, embed, "cpu").layer(ids[None], fused[None], pos[None], None, [])
    _, want = ref.reference_draft_step({k: v.float() for k, v in w.items()}, ids, pos, fused, embed,
                                       yarn=cfg["rope_scaling"])
    torch.testing.assert_close(pre[0], want, atol=1e-5, rtol=1e-5)


def test_mla_drafter_trains_through_the_bench_loop(tmp_path):
    """train_mla runs bench_eagle3.train's loop with the MLA layer and writes
    a checkpoint of the drafter's own layout."""
    from safetensors.torch import load_file

    import serving_pairs as sp

    d, cfg, w = _mla_drafter(tmp_path)
    target = tmp_path / "target"
    target.mkdir()
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    save_file({"language_model.model.embed_tokens.weight": torch.randn(cfg["vocab_size"], 128, generator=g)},
              str(target / "model.safetensors"))
    # Target ids over the whole vocabulary (the drafter predicts target ids).
    seqs = [[int(x) for x in torch.randint(0, cfg["vocab_size"], (24,), generator=g)] for _ in range(16)]
    torch.save({"aux": [torch.randn(24, 3 * 128, generator=g) for _ in seqs], "missing": [],
                "layer_ids": [1, 3, 6]}, tmp_path / "aux.pt")
    out = tmp_path / "trained"
    rec = sp.train_mla(target, d, seqs, [8] * len(seqs), tmp_path / "aux.pt", out, 3, "cpu")
    assert rec["steps"] == 3
    new = load_file(str(out / "model.safetensors"))
    assert set(new) == set(w)
    assert torch.equal(new["d2t"], w["d2t"])
    # The loop trained: finite losses, and the validation loss moved (the
    # weights kept are the best validation point's, here maybe the first).
    log = rec["log"]
    assert [r["step"] for r in log] == [-1, 0, 2]
    assert all(math.isfinite(r["train_loss"]) for r in log[1:])
    assert log[-1]["val_loss"] != log[0]["val_loss"]


# --- trained pairs that travel between device calls (serving_pairs.py) ---------


def test_a_packed_kimi_pair_unpacks_with_its_view_rebuilt(tmp_path):
    """pack keeps pair.json and the checkpoints it names but the view;
    unpack into the same work dir rebuilds the view from the INT4 target,
    byte-equal to the one prepare wrote; elsewhere it refuses, naming the dir."""
    import json
    import shutil
    import tarfile

    from safetensors.torch import load_file

    import int4_check
    import serving_pairs as sp
    from gpu_e2e_helpers import MLA_GEOMETRY
    from tiny_checkpoints import kimi_text_view, write_checkpoint, write_kimi_k25_int4

    work = tmp_path / "kimi"
    write_checkpoint("kimi-k25", work / "bf16", seed=7, dtype="bfloat16", **MLA_GEOMETRY)
    write_kimi_k25_int4(work / "bf16", work / "int4", int4_check.published_quantization_config())
    kimi_text_view(work / "int4", work / "view")
    (work / "drafter").mkdir()
    (work / "drafter" / "config.json").write_text("{}")
    (work / "aux.pt").write_bytes(b"training data")
    info = {"kind": "kimi-k25-int4", "target": str(work / "int4"), "view": str(work / "view"),
            "mla_drafter": str(work / "drafter")}
    (work / "pair.json").write_text(json.dumps(info))
    before = load_file(str(work / "view" / "model.safetensors"))

    sp.pack(work, tmp_path / "pair.tgz")
    names = {n.split("/")[0] for n in tarfile.open(tmp_path / "pair.tgz").getnames()}
    assert names == {"pair.json", "int4", "drafter"}
    shutil.rmtree(work)
    assert sp.unpack(tmp_path / "pair.tgz", work)["kind"] == "kimi-k25-int4"
    after = load_file(str(work / "view" / "model.safetensors"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(SystemExit, match="unpack it into the directory it was prepared in"):
        sp.unpack(tmp_path / "pair.tgz", tmp_path / "elsewhere")
    assert not (tmp_path / "elsewhere").exists()
