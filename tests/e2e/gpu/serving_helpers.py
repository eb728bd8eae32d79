# SPDX-License-Identifier: Apache-2.0
"""The parts of test_eagle3_serving.py that need no GPU: engine counters
(offline ``LLM.get_metrics()`` and the server's ``/metrics`` text), the
request generators, and the sampling statistics. Their CPU tests:
tests/e2e/gpu/test_serving_helpers.py (run in CI).

Everything here is plain Python, numpy, prometheus_client and (for the
chi-square tail) torch; nothing imports vLLM.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import gpu_e2e_helpers  # noqa: F401 - puts tools/ and tools/gpu_harness on sys.path

# ---------------------------------------------------------------------------
# engine counters
# ---------------------------------------------------------------------------

# The counters (cumulative) each case reads, by their Prometheus names
# without the ``_total`` sample suffix (vllm/v1/metrics/loggers.py).
COUNTERS = {
    "vllm:prefix_cache_queries": "prefix_cache_queries",
    "vllm:prefix_cache_hits": "prefix_cache_hits",
    "vllm:num_preemptions": "num_preemptions",
    "vllm:prompt_tokens": "prompt_tokens",
    "vllm:generation_tokens": "generation_tokens",
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
GAUGES = {
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    "vllm:num_requests_running": "num_requests_running",
    "vllm:num_requests_waiting": "num_requests_waiting",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
REQUEST_SUCCESS = "vllm:request_success"


def _empty() -> dict[str, Any]:
    out: dict[str, Any] = {v: 0 for v in COUNTERS.values()}
    out.update({v: 0.0 for v in GAUGES.values()})
    out["accepted_per_position"] = []
    out["request_success"] = {}
    return out


def _add_vec(a: list, b: Sequence) -> list:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


def counters_from_llm_metrics(metrics: Iterable[Any]) -> dict[str, Any]:
    """Sum (over engines and labels) the metrics ``LLM.get_metrics()`` returns
    (vllm.v1.metrics.reader: Counter, Gauge, Vector, Histogram objects)."""
    out = _empty()
    for m in metrics:
        if m.name in COUNTERS:
            out[COUNTERS[m.name]] += int(m.value)
        elif m.name in GAUGES:
            out[GAUGES[m.name]] += float(m.value)
        elif m.name == PER_POS:
            out["accepted_per_position"] = _add_vec(out["accepted_per_position"], [int(v) for v in m.values])
        elif m.name == REQUEST_SUCCESS:
            reason = m.labels.get("finished_reason", "?")
            out["request_success"][reason] = out["request_success"].get(reason, 0) + int(m.value)
    return out


def counters_from_prometheus(text: str) -> dict[str, Any]:
    """The same summary from a server's ``/metrics`` text (prometheus_client's
    own parser; counters are read from their ``_total`` samples)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = _empty()
    per_pos: dict[int, int] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            name = s.name
            base = name[:-len("_total")] if name.endswith("_total") else name
            if fam.type == "counter" and name.endswith("_total"):
                if base in COUNTERS:
                    out[COUNTERS[base]] += int(s.value)
                elif base == PER_POS:
                    pos = int(s.labels.get("position", 0))
                    per_pos[pos] = per_pos.get(pos, 0) + int(s.value)
                elif base == REQUEST_SUCCESS:
                    reason = s.labels.get("finished_reason", "?")
                    out["request_success"][reason] = out["request_success"].get(reason, 0) + int(s.value)
            elif fam.type == "gauge" and name in GAUGES:
                out[GAUGES[name]] += float(s.value)
    if per_pos:
        out["accepted_per_position"] = [per_pos.get(i, 0) for i in range(max(per_pos) + 1)]
    return out


def delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Counters: after - before; gauges: the value after. Adds the derived
    rates (mean acceptance length, prefix-cache hit rate)."""
    d: dict[str, Any] = {}
    for k in COUNTERS.values():
        d[k] = after[k] - before[k]
    for k in GAUGES.values():
        d[k] = after[k]
    a, b = after["accepted_per_position"], before["accepted_per_position"]
    d["accepted_per_position"] = [x - (b[i] if i < len(b) else 0) for i, x in enumerate(a)]
    d["request_success"] = {r: n - before["request_success"].get(r, 0)
                            for r, n in after["request_success"].items()}
    d["mean_acceptance_length"] = (1 + d["num_accepted_tokens"] / d["num_drafts"]) if d["num_drafts"] else None
    d["prefix_cache_hit_rate"] = (d["prefix_cache_hits"] / d["prefix_cache_queries"]
                                  if d["prefix_cache_queries"] else None)
    return d


# vLLM's own record of each engine step, logged with
# --enable-logging-iteration-details (EngineCore.log_iteration_details):
# the tokens the scheduler gave the step, split into context (prefill,
# including every chunk of a chunked prompt) and generation. The
# vllm:iteration_tokens_total histogram cannot show chunking: it observes a
# prompt's whole length on the step its prefill completes.
_ITERATION = (r"Iteration\((\d+)\): (\d+) context requests, (\d+) context tokens, "
              r"(\d+) generation requests, (\d+) generation tokens")


def iteration_details(text: str) -> list[dict[str, int]]:
    """Every "Iteration(N): ..." line of a server log, in order."""
    import re

    keys = ("iteration", "context_requests", "context_tokens", "generation_requests", "generation_tokens")
    return [dict(zip(keys, map(int, m))) for m in re.findall(_ITERATION, text)]


def spec_counter_problems(d: dict[str, Any], k: int) -> list[str]:
    """What is wrong with a spec-decode counter delta (empty: consistent).
    For a chain drafter: k draft tokens per draft; position i accepted at
    most as often as position i - 1 and at most once per draft; the
    positions sum to the accepted total."""
    p: list[str] = []
    drafts, drafted, acc = d["num_drafts"], d["num_draft_tokens"], d["num_accepted_tokens"]
    per = list(d["accepted_per_position"] or [])
    if drafted != k * drafts:
        p.append(f"draft tokens {drafted} != k * drafts = {k} * {drafts}")
    if acc > drafted:
        p.append(f"accepted {acc} > drafted {drafted}")
    if per and len(per) != k:
        p.append(f"{len(per)} positions, expected k = {k}")
    if per and sum(per) != acc:
        p.append(f"per-position sum {sum(per)} != accepted {acc}")
    for i, n in enumerate(per):
        if n < 0 or n > drafts:
            p.append(f"position {i}: {n} accepted of {drafts} drafts")
        if i and n > per[i - 1]:
            p.append(f"position {i} accepted {n} > position {i - 1} ({per[i - 1]})")
    return p


# ---------------------------------------------------------------------------
# requests: the trained targets' skip-rule language (bench_eagle3.py)
# ---------------------------------------------------------------------------

# The language the pairs are trained on: t[i+1] = f(t[i-1]) with 15% noise.
from tools.gpu_harness.data import rule_sequence, skip_rule  # noqa: E402

def rule_prompts(n: int, seed: int, lo: int = 8, hi: int = 24) -> list[list[int]]:
    rng, f = random.Random(seed), skip_rule()
    return [rule_sequence(rng, f, rng.randint(lo, hi)) for _ in range(n)]


@dataclass
class Workload:
    """Token-id prompts and the greedy tokens each gets (``max_tokens``)."""
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]
    # Requests that must run before the others (e.g. the first request of a
    # shared prefix, so the others can hit its cached blocks).
    warm: int = 0
    info: dict[str, Any] = field(default_factory=dict)


def prefix_workload(system_len: int = 1536, n_users: int = 15, user_len: int = 48,
                    max_tokens: int = 48, seed: int = 100) -> Workload:
    """Requests sharing one system prompt of ``system_len`` tokens: one warm
    request, then ``n_users`` distinct user turns."""
    rng, f = random.Random(seed), skip_rule()
    system = rule_sequence(rng, f, system_len)
    prompts = [system + rule_sequence(rng, f, user_len) for _ in range(n_users + 1)]
    return Workload("prefix", prompts, [max_tokens] * len(prompts), warm=1,
                    info={"system_prompt_tokens": system_len, "user_tokens": user_len})


def conversation_turn(history: list[int], reply: list[int], seed: int, user_len: int = 48) -> list[int]:
    """The next turn's prompt: everything so far, the model's reply and a new user message."""
    rng, f = random.Random(seed), skip_rule()
    return history + reply + rule_sequence(rng, f, user_len)


def long_workload(n: int = 2, length: int = 8192, max_tokens: int = 64, seed: int = 200) -> Workload:
    rng, f = random.Random(seed), skip_rule()
    return Workload("long", [rule_sequence(rng, f, length + i) for i in range(n)], [max_tokens] * n,
                    info={"prompt_tokens": [length + i for i in range(n)]})


def preemption_workload(n: int = 64, max_tokens: int = 256, seed: int = 300) -> Workload:
    rng = random.Random(seed)
    prompts = rule_prompts(n, seed, lo=96, hi=192)
    return Workload("preemption", prompts, [max_tokens - rng.randrange(0, 64) for _ in range(n)])


def kv_tokens_needed(w: Workload, k: int) -> int:
    """KV slots all of ``w`` needs at once (prompt + output + k lookahead)."""
    return sum(len(p) + m + k for p, m in zip(w.prompts, w.max_tokens))


@dataclass
class SoakRequest:
    prompt: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    n: int
    stop: list[str] | None
    disconnect_after: int | None  # chunks read before the client goes away


def soak_request(rng: random.Random, system: list[int], f: list[int]) -> SoakRequest:
    """One request of the mixed soak: greedy or sampled, n = 1 or 2, a stop
    string or none, 16..256 tokens, a shared prefix, a long prompt or a short
    one; about one in eight clients disconnects mid-stream."""
    kind = rng.random()
    if kind < 0.4:
        prompt = system + rule_sequence(rng, f, rng.randint(16, 64))
    elif kind < 0.5:
        prompt = rule_sequence(rng, f, rng.randint(3000, 6000))
    else:
        prompt = rule_sequence(rng, f, rng.randint(8, 256))
    sampled = rng.random() < 0.5
    return SoakRequest(
        prompt=prompt, max_tokens=rng.choice((16, 64, 128, 256)),
        temperature=0.8 if sampled else 0.0, top_p=0.95 if sampled else 1.0,
        n=2 if sampled and rng.random() < 0.3 else 1,
        # Byte-level tokens: a stop string of one byte fires now and then.
        stop=[chr(0x41 + rng.randrange(26))] if rng.random() < 0.2 else None,
        disconnect_after=rng.randint(1, 20) if rng.random() < 0.125 else None,
    )


# ---------------------------------------------------------------------------
# sampling statistics
# ---------------------------------------------------------------------------


def nucleus(logits: Sequence[float], temperature: float, top_p: float):
    """Float64 probabilities after temperature and top-p, as vLLM's sampler
    defines them (vllm/v1/sample/ops/topk_topp_sampler.py, apply_top_k_top_p:
    sort ascending, drop the tokens whose cumulative probability is at most
    1 - top_p, always keep the largest). Returns (probs, kept mask)."""
    import numpy as np

    z = np.asarray(logits, dtype=np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(p, kind="stable")  # ascending
    cum = np.cumsum(p[order])
    drop = cum <= 1 - top_p
    drop[-1] = False
    keep = np.ones_like(p, dtype=bool)
    keep[order[drop]] = False
    q = np.where(keep, p, 0.0)
    return q / q.sum(), keep


def rank_bins(q, token: int, n_bins: int = 3):
    """(bin of ``token``, expected mass of each bin) for one position: bin r
    < n_bins - 1 holds the token of rank r under ``q``, the last bin all the
    rest. Ranks are by probability (ties by token id), so near-tied tail
    tokens only move mass inside the last bin."""
    import numpy as np

    q = np.asarray(q, dtype=np.float64)
    order = np.lexsort((np.arange(len(q)), -q))
    head = order[: n_bins - 1]
    mass = np.empty(n_bins)
    mass[: n_bins - 1] = q[head]
    mass[-1] = max(0.0, 1.0 - mass[: n_bins - 1].sum())
    pos = np.nonzero(head == token)[0]
    return (int(pos[0]) if len(pos) else n_bins - 1), mass


@dataclass
class SamplingTest:
    """Observed vs expected bin counts of tokens sampled position by
    position, each position with its own reference distribution."""
    observed: list[int]
    expected: list[float]
    statistic: float
    dof: int
    p_value: float
    positions: int
    outside_nucleus: int
    # The smallest shift of the top-1 bin's share this many samples detect
    # at the test's alpha with 95% power.
    detectable_top1_shift: float
    top1_share_observed: float
    top1_share_expected: float

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def sampling_test(bins: Sequence[int], masses: Sequence[Sequence[float]], outside: int = 0,
                  alpha: float = 1e-3) -> SamplingTest:
    """Whether the tokens fall in the bins as often as the reference says.

    ``bins[t]`` is the bin position t's token fell in and ``masses[t]`` each
    bin's probability under the reference at t. Given the past, each
    position is one multinomial draw, so O - E over all positions is a sum of
    martingale differences with covariance C = sum_t (diag(m_t) - m_t m_t^T);
    (O - E)^T C^+ (O - E) is chi-square with (bins - 1) degrees of freedom
    (the generalised Pearson statistic for draws that are not identically
    distributed)."""
    from statistics import NormalDist

    import numpy as np
    import torch

    m = np.asarray(masses, dtype=np.float64)
    n_pos, k = m.shape
    obs = np.zeros(k)
    np.add.at(obs, np.asarray(bins, dtype=np.int64), 1)
    exp = m.sum(0)
    cov = np.diag(exp) - m.T @ m
    diff = obs - exp
    # The bins sum to the number of positions: drop the last one (C is
    # singular along the all-ones direction).
    c = cov[:-1, :-1]
    stat = float(diff[:-1] @ np.linalg.solve(c, diff[:-1]))
    dof = k - 1
    # chi-square survival function: the regularised upper incomplete gamma.
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(stat / 2, dtype=torch.float64)))
    var1 = float((m[:, 0] * (1 - m[:, 0])).sum())
    z = NormalDist().inv_cdf(1 - alpha / 2) + NormalDist().inv_cdf(0.95)
    return SamplingTest(
        observed=[int(x) for x in obs], expected=[float(x) for x in exp], statistic=stat, dof=dof,
        p_value=p_value, positions=int(n_pos), outside_nucleus=int(outside),
        detectable_top1_shift=float(z * math.sqrt(var1) / n_pos),
        top1_share_observed=float(obs[0] / n_pos), top1_share_expected=float(exp[0] / n_pos),
    )


def speculative_sample(rng, q_fn, draft_fn, prefix: list[int], n_tokens: int, k: int,
                       accept_all: bool = False) -> list[int]:
    """Speculative sampling of ``n_tokens`` with a greedy (one-hot) drafter,
    as vLLM's rejection sampler does it when the proposer gives no draft
    probabilities (rejection_random_sample_kernel, NO_DRAFT_PROBS): accept
    draft d with probability q(d), else sample from q with d removed; after
    k accepted drafts, a bonus token from q. ``accept_all`` is the broken
    rule (every draft kept). q_fn(seq) -> float64 probabilities of the next
    token; draft_fn(seq) -> the drafter's token. Used by the CPU tests to
    show sampling_test passes the right rule and fails the broken one."""
    import numpy as np

    seq = list(prefix)
    out: list[int] = []
    while len(out) < n_tokens:
        drafts = []
        ctx = list(seq)
        for _ in range(k):
            d = draft_fn(ctx)
            drafts.append(d)
            ctx.append(d)
        for d in drafts:
            q = q_fn(seq)
            if accept_all or rng.random() < q[d]:
                tok = d
            else:
                r = np.array(q, dtype=np.float64)
                r[d] = 0.0
                tok = int(rng.choice(len(r), p=r / r.sum()))
            seq.append(tok)
            out.append(tok)
            if tok != d or len(out) >= n_tokens:
                break
        else:
            if len(out) < n_tokens:
                q = q_fn(seq)
                tok = int(rng.choice(len(q), p=q))
                seq.append(tok)
                out.append(tok)
    return out[:n_tokens]


# ---------------------------------------------------------------------------
# the OpenAI server
# ---------------------------------------------------------------------------


class Server:
    """``python -m vllm.entrypoints.openai.api_server ARGS`` in a child
    process, its output in ``log``; ``start()`` waits for /health."""

    def __init__(self, args: list[str], log_path, port: int | None = None):
        import sys

        self.port = port or free_port()
        self.cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args,
                    "--port", str(self.port), "--host", "127.0.0.1"]
        self.log_path = log_path
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = None
        self.ready_s: float | None = None

    def start(self, timeout_s: float = 400) -> Server:
        return self.launch().wait_ready(timeout_s)

    def launch(self) -> Server:
        """Start the process and return (its start-up overlaps other work)."""
        import os
        import subprocess
        import time

        self._log = open(self.log_path, "w")
        # Unbuffered: a case reads the engine's log lines of its own requests.
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._t0 = time.perf_counter()
        return self

    def wait_ready(self, timeout_s: float = 400) -> Server:
        import time

        t0 = self._t0
        while not self.healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; log {self.log_path}:\n"
                                   + tail(self.log_path))
            if time.perf_counter() - t0 > timeout_s:
                raise TimeoutError(f"server not healthy after {timeout_s} s:\n" + tail(self.log_path))
            time.sleep(1)
        self.ready_s = time.perf_counter() - t0
        return self

    def healthy(self) -> bool:
        import urllib.request

        try:
            return urllib.request.urlopen(self.base + "/health", timeout=2).status == 200
        except Exception:
            return False

    def log_size(self) -> int:
        import os

        return os.path.getsize(self.log_path)

    def log_since(self, offset: int) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def metrics_text(self) -> str:
        import urllib.request

        return urllib.request.urlopen(self.base + "/metrics", timeout=10).read().decode()

    def counters(self) -> dict[str, Any]:
        return counters_from_prometheus(self.metrics_text())

    def stop(self) -> None:
        import subprocess

        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if getattr(self, "_log", None):
            self._log.close()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path, n: int = 60) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def logged_kv_tokens(log_path) -> list[int]:
    """The engine's own "GPU KV cache size: N tokens" lines (vLLM logs one
    per KV-cache spec at start-up)."""
    import re

    try:
        text = open(log_path, errors="replace").read()
    except OSError:
        return []
    return [int(x.replace(",", "")) for x in re.findall(r"GPU KV cache size: ([\d,]+) tokens", text)]
